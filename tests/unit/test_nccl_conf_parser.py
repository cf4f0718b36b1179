"""The /etc/nccl.conf pvegpu writes, read by NCCL's own parser: `setEnvFile()` taken from NCCL's
src/misc/param.cc (fetched by URL + sha256 through scripts/fetch-upstream.sh, never kept in the
repo) at three releases, compiled into a tiny harness that prints the environment it leaves.

2.18 and 2.25 do not skip `#` lines: any line with an `=` sets a variable named by what stands
before it; 2.26+ skips them. All take values verbatim and cut them at 1023 characters."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plan.nccl import nccl_environment, render_nccl_conf
from tests.unit.test_p2p import kpro6_verdict

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("2.18.1", "2.25.1", "2.30.7")

# Only what NCCL's function needs around it; ncclOsSetEnv is src/os/linux.cc's: setenv without
# overwriting (2.30); older releases call setenv(..., 0) themselves.
PRELUDE = """#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/types.h>
#include <unistd.h>
extern char **environ;
static void ncclOsSetEnv(const char* name, const char* value) { setenv(name, value, 0); }
"""
MAIN = """
int main(int argc, char** argv) {
  if (argc != 2) return 2;
  clearenv();
  setEnvFile(argv[1]);
  for (char** e = environ; e && *e; ++e) { fputs(*e, stdout); fputc('\\n', stdout); }
  return 0;
}
"""


def _set_env_file(source: str) -> str:
    """NCCL's setEnvFile() definition: from its signature to the first `}` at column 0."""
    match = re.search(r"^void setEnvFile\(const char\* ?fileName\) \{\n.*?^\}\n", source, re.M | re.S)
    assert match, "setEnvFile() not found in param.cc"
    return match.group(0)


@pytest.fixture(scope="module")
def nccl_readers(tmp_path_factory) -> dict:
    if not shutil.which("g++"):
        pytest.skip("no g++ to build NCCL's nccl.conf reader")
    readers = {}
    for version in VERSIONS:
        out = subprocess.run([str(REPO / "scripts/fetch-upstream.sh"), f"nccl-param-{version}"],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            if "download failed" in out.stderr:  # no network and no shared or cached copy
                pytest.skip(f"NCCL {version} param.cc not available: {out.stderr.strip()[-300:]}")
            pytest.fail(f"fetch-upstream nccl-param-{version}: {out.stderr.strip()}")
        source = Path(out.stdout.strip()).read_text()
        build = tmp_path_factory.mktemp(f"nccl-{version}")
        (build / "reader.cc").write_text(PRELUDE + _set_env_file(source) + MAIN)
        subprocess.run(["g++", "-O0", "-o", str(build / "reader"), str(build / "reader.cc")], check=True,
                       capture_output=True, timeout=300)
        readers[version] = build / "reader"
    return readers


def nccl_reads(reader: Path, text: str, tmp_path: Path) -> dict:
    conf = tmp_path / "nccl.conf"
    conf.write_text(text)
    out = subprocess.run([str(reader), str(conf)], capture_output=True, text=True, check=True, timeout=30)
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


@pytest.mark.parametrize("version", VERSIONS)
def test_every_release_reads_exactly_our_variables(nccl_readers, version, tmp_path):
    env = nccl_environment(kpro6_verdict(), nccl={"overrides": {"NCCL_DEBUG": "WARN", "NCCL_P2P_LEVEL": "PIX"}})
    assert set(env) == {"NCCL_DEBUG", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_WIN_ENABLE"}
    text = render_nccl_conf(env, scope="host kpro6")
    assert nccl_reads(nccl_readers[version], text, tmp_path) == {name: e["value"] for name, e in env.items()}


def test_the_harness_is_nccls_parser_comments_with_an_equals_sign_become_variables_before_2_26(nccl_readers, tmp_path):
    text = "# NCCL reads NAME=value lines\nNCCL_DEBUG=\"WARN\"\nNCCL_ALGO=" + "x" * 1100 + "\n"
    old = nccl_reads(nccl_readers["2.25.1"], text, tmp_path)
    new = nccl_reads(nccl_readers["2.30.7"], text, tmp_path)
    assert old["# NCCL reads NAME"] == "value lines" and "# NCCL reads NAME" not in new
    assert old["NCCL_DEBUG"] == new["NCCL_DEBUG"] == '"WARN"'  # verbatim: the quotes are part of it
    assert len(new["NCCL_ALGO"]) == 1023
