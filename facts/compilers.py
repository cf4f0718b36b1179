"""What GCC prints about itself, read in one place: the kernel's /proc/version and
CONFIG_CC_VERSION_TEXT, `gcc --version`, NVIDIA's /proc/driver/nvidia/version and the .comment of
objects (a pure parser; facts.kernel, facts.nvidia and plan/ read compiler versions through it)."""

from __future__ import annotations

import re

# GCC's version inside the text GCC prints about itself, in the forms the kernel and NVIDIA's driver
# quote it (ASCII digits; GCC 4.x and later name x.y.z, prereleases too):
# - `gcc version 4.8.4 (Ubuntu 4.8.4-2ubuntu1~14.04.3)`: the last line of `$CC -v` (gcc/gcc.cc: "gcc",
#   "version", version_string, pkgversion; the two words are translated, so a build under another
#   locale printed them otherwise: the kernel's mkcompile_h ran it under LC_ALL=C), which the kernel's scripts/mkcompile_h put
#   into LINUX_COMPILER up to 5.7 (/proc/version: "(gcc version 4.8.4 (Ubuntu …) )") and NVIDIA's
#   /proc/driver/nvidia/version prints after "GCC version:";
# - `gcc-12 (Debian 12.2.0-14) 12.2.0`: the first line of `$CC --version` (driver::maybe_print_and_exit:
#   program name, "(pkgversion)" -- "(GCC)" unless configured otherwise, none when configured empty --
#   then version_string, which may go on: `11.4.1 20231218 (Red Hat 11.4.1-3)`), init/Kconfig's
#   CC_VERSION_TEXT since 5.8, hence /proc/version's "(gcc-12 (Debian …) 12.2.0, GNU ld …)";
# - `GCC: (Debian 12.2.0-14) 12.2.0`: the .comment GCC writes into every object (its .ident).
# The version is the word after "gcc version", or after the program and its parenthesised pkgversion:
# never the last x.y.z of the line (14.04.3 in Ubuntu's pkgversion above).
_GCC_DASH_V = re.compile(r"\bgcc version ([0-9]+(?:\.[0-9]+)+)\b")
# the GCC drivers' program names as --version prints them (argv[0]'s base name; Debian's gcc-N,
# g++-N, their target-prefixed names, and the cc/c++ alternatives): gcc, g++, c++, cc
_GCC_DRIVER = re.compile(r"(?:^|[-/])(?:gcc|g\+\+|c\+\+|cc)(?:-[0-9]+(?:\.[0-9]+)*)?$", re.I)
_GCC_BANNER = re.compile(r"^\s*(\S+)\s+(?:\((?:[^()]|\([^()]*\))*\)\s+)?([0-9]+(?:\.[0-9]+)+)(?![0-9A-Za-z.])")


def compiler_version(text: str | None) -> str | None:
    """GCC's version in what GCC prints about itself (`_GCC_BANNER`'s forms): `gcc-12 (Debian
    12.2.0-14) 12.2.0` → `12.2.0` (g++, c++ and cc print the same under their names), `gcc version
    4.8.4 (Ubuntu 4.8.4-2ubuntu1~14.04.3)` → `4.8.4`; None for another compiler (`Debian clang
    version 14.0.6`) or no version."""
    if not text:
        return None
    match = _GCC_DASH_V.search(text)
    if match:
        return match.group(1)
    match = _GCC_BANNER.match(text)
    if match and ("gcc" in match.group(1).lower() or _GCC_DRIVER.search(match.group(1))):
        return match.group(2)
    return None
