"""facts.nvidia.COMPILER_BANNERS: each gcc/g++ program's first --version line, the program that is
the same file as the one asked before it (Debian's gcc -> gcc-12 links) not run again, its line
what running it prints (GCC's driver names itself by argv[0]'s last component)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from facts.nvidia import COMPILER_BANNERS, parse_host_state

# the loop before: every program run
OLD = ('for c in /usr/bin/gcc /usr/bin/gcc-[0-9]* /usr/bin/g++ /usr/bin/g++-[0-9]*; do '
       '[ -x "$c" ] && echo "${c##*/}: $("$c" --version 2>/dev/null | head -n 1)"; done')


def _compilers(tmp_path: Path) -> tuple[Path, Path]:
    """gcc-12 and g++-12 as Debian has them (gcc, g++ links to them), a gcc-13 of its own, a gcc-14
    that fails, and a gcc-9 that is not executable; each logs its runs."""
    bin_dir, log = tmp_path / "bin", tmp_path / "runs.log"
    bin_dir.mkdir()
    for name, banner in {"x86_64-linux-gnu-gcc-12": "(Debian 12.2.0-14+deb12u1) 12.2.0",
                         "x86_64-linux-gnu-g++-12": "(Debian 12.2.0-14+deb12u1) 12.2.0",
                         "gcc-13": "(Debian 13.2.0-25) 13.2.0", "gcc-14": None, "gcc-9": "(x) 9"}.items():
        body = (f'echo "${{0##*/}} {banner}"; echo "Copyright (C) 2022 Free Software Foundation, Inc."'
                if banner else "exit 1")
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$0" >> {log}\n{body}\n')
        (bin_dir / name).chmod(0o644 if name == "gcc-9" else 0o755)
    for link, target in {"gcc-12": "x86_64-linux-gnu-gcc-12", "gcc": "gcc-12",
                         "g++-12": "x86_64-linux-gnu-g++-12", "g++": "g++-12"}.items():
        (bin_dir / link).symlink_to(target)
    return bin_dir, log


def _run(command: str, bin_dir: Path) -> list[str]:
    return subprocess.run(["sh", "-c", command.replace("/usr/bin/g", f"{bin_dir}/g")], capture_output=True,
                          text=True, timeout=60).stdout.splitlines()


def test_one_run_per_program_file_and_the_lines_every_run_prints(tmp_path):
    bin_dir, log = _compilers(tmp_path)
    old = _run(OLD, bin_dir)
    assert len(log.read_text().splitlines()) == 6  # gcc, gcc-12, gcc-13, gcc-14, g++, g++-12
    log.unlink()
    new = _run(COMPILER_BANNERS, bin_dir)
    assert new == old
    assert "gcc-12: gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0" in new and "gcc-14: " in new
    # gcc-12 and g++-12 are the files gcc and g++ were: not run again
    assert [Path(p).name for p in log.read_text().splitlines()] == ["gcc", "gcc-13", "gcc-14", "g++"]
    compilers = parse_host_state(["@@ compilers", *new])["compilers"]
    assert compilers["gcc"] == "gcc (Debian 12.2.0-14+deb12u1) 12.2.0" and "gcc-9" not in compilers


# Issue 43 item 4: GCC's version where GCC prints it (facts.compilers), every reader through it
@pytest.mark.parametrize("text, version", [
    # /proc/version before 5.8 (mkcompile_h: `$CC -v`'s last line), tests/fixtures/proc-version/
    ("gcc version 4.8.4 (Ubuntu 4.8.4-2ubuntu1~14.04.3) ", "4.8.4"),
    ("gcc version 5.4.0 20160609 (Ubuntu 5.4.0-6ubuntu1~16.04.2) ", "5.4.0"),
    ("gcc version 7.1.1 20170622 (Red Hat 7.1.1-3) (GCC) ", "7.1.1"),
    # CONFIG_CC_VERSION_TEXT / `--version` first lines: Debian, upstream, the H200 VM's kernel
    ("gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "12.2.0"),
    ("x86_64-linux-gnu-gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "12.2.0"),
    ("gcc (GCC) 15.3.0", "15.3.0"),
    # the .comment of a module GCC built (what tests/host reads with readelf -p .comment)
    ("GCC: (Debian 12.2.0-14+deb12u1) 12.2.0", "12.2.0"),
    # NVIDIA's "GCC version:" line (the driver's NV_COMPILER: `$(CC) -v | tail -n 1`)
    (" gcc version 12.2.0 (Debian 12.2.0-14)", "12.2.0"),
    # GCC's C++ and cc drivers print the same first line under their own program name (the G++
    # banner the NVIDIA stage compares with its gcc's: plan.nvidia toolchain_for)
    ("g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "12.2.0"),
    ("x86_64-linux-gnu-g++-14 (Debian 14.2.0-19) 14.2.0", "14.2.0"),
    ("g++ (GCC) 15.3.0", "15.3.0"),
    ("c++ (Debian 12.2.0-14) 12.2.0", "12.2.0"),
    ("cc (Debian 12.2.0-14) 12.2.0", "12.2.0"),
    # not GCC
    ("Debian clang version 14.0.6", None),
    ("clang++ 14.0.6", None),
    ("rustc 1.63.0", None),
    ("", None),
])
def test_gcc_version_is_the_word_gcc_prints_as_its_version(text, version):
    from facts.compilers import compiler_version

    assert compiler_version(text) == version
