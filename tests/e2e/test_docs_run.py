"""Issue 42: the tutorial and the how-to guides run, as written, against one twin.

The shell blocks of every page of tests/docs_pages.PAGES run in that order (the tutorial leaves
the twin converged for the guides) in one shell state, as a reader pasting them into one
terminal would: what a block exports or defines is there for the next (also across pages). Each
block must exit 0 and print each of its `<!-- expect: … -->` texts. Blocks marked real-host-only
or not-in-ci are not run (tests/unit/test_docs_pages.py holds them to a reason); `at-end` blocks
run after the last page. The pages name the twin `kpro6` (`export TWIN=kpro6`); here it is a name
of this test's own, so a twin of someone's `make demo` is never touched.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.docs_pages import PAGES, REPO, Block, blocks
from tests.twin import runtime

TWIN_LINE = re.compile(r"^export TWIN=\S+$", re.M)
# variables bash itself keeps; a block's state must not set them
_OWN = re.compile(r"^declare -\S+ (BASHOPTS|SHELLOPTS|BASH_\w+|PWD|OLDPWD|SHLVL|_)=", re.M)


def run_block(block: Block, state: Path, twin: str, timeout: int = 600) -> tuple[int, str, float]:
    text = TWIN_LINE.sub(f"export TWIN={twin}", block.text)
    script = (f"[ -f {state} ] && . {state}\n"
              f"trap '{{ export -p; declare -f; }} > {state}.new' EXIT\n"
              "set -eo pipefail\n" + text)
    started = time.monotonic()
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env=os.environ | {"PYTHONUNBUFFERED": "1"})
    new = Path(f"{state}.new")
    if new.exists():
        state.write_text(_OWN.sub(lambda m: "# " + m.group(0), new.read_text()))
    return out.returncode, out.stdout + out.stderr, time.monotonic() - started


@pytest.mark.twin
def test_the_tutorial_and_guides_run_on_a_twin(twin_root_cache, tmp_path):
    twin = f"docs-{os.getpid() % 100000}"
    state = tmp_path / "state.sh"
    later: list[Block] = []
    timings: list[str] = []
    try:
        for page in PAGES:
            for block in blocks(page):
                if not block.runs:
                    continue
                if block.mark == "at-end":
                    later.append(block)
                    continue
                rc, output, took = run_block(block, state, twin)
                timings.append(f"{block.where()}: {took:.1f} s")
                assert rc == 0, f"{block.where()} exited {rc}:\n{block.text}\n--- output:\n{output[-6000:]}"
                for text in block.expect:
                    assert text in output, f"{block.where()} did not print {text!r}:\n{block.text}\n--- output:\n" \
                                           f"{output[-6000:]}"
        for block in later:
            rc, output, took = run_block(block, state, twin)
            timings.append(f"{block.where()}: {took:.1f} s")
            assert rc == 0, f"{block.where()} exited {rc}:\n{block.text}\n--- output:\n{output[-6000:]}"
    finally:
        print("\n".join(timings))
        for name in [t["name"] for t in runtime.status()]:
            if name == twin or name.startswith(twin + "-"):
                runtime.stop(name)
