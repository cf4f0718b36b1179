"""The shell blocks of the task pages (docs/tutorial.md, docs/howto/*.md), as the docs tests read them.

A block is a fence whose info string is `sh`. Comments on the lines right before it mark it:

    <!-- real-host-only: REASON -->   not run: it needs a real host (REASON says why)
    <!-- not-in-ci: REASON -->        runs on the twin, too slow for CI (REASON names what covers it)
    <!-- at-end -->                   run after every page (stopping the twin the pages share)

and comments right after it say what it must print (each text somewhere in its output):

    <!-- expect: No changes -->

tests/unit/test_docs_pages.py checks the markup; tests/e2e/test_docs_run.py runs the blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# the order the pages run in, on one twin: the tutorial leaves it converged for the guides
PAGES = [
    "tutorial.md",
    "howto/first-host.md",
    "howto/move-gpus.md",
    "howto/restore-backup.md",
    "howto/kernel-update.md",
    "howto/trial-failed.md",
    "howto/recover-hook.md",
    "howto/upgrade-8-to-9.md",
    "howto/add-node.md",
]
MARK = re.compile(r"^<!--\s*(real-host-only|not-in-ci|at-end)\s*(?::\s*(.*?))?\s*-->$")
EXPECT = re.compile(r"^<!--\s*expect:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    text: str
    mark: str | None = None  # real-host-only, not-in-ci, at-end
    reason: str = ""
    expect: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return self.mark not in ("real-host-only", "not-in-ci")

    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def task_pages() -> list[str]:
    """Every page the docs tests cover: the tutorial and each how-to guide."""
    return ["tutorial.md"] + sorted(f"howto/{p.name}" for p in (DOCS / "howto").glob("*.md"))


def blocks(page: str) -> list[Block]:
    lines = (DOCS / page).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        if info == "sh":
            block = Block(page, start + 1, "\n".join(lines[start + 1:j]) + "\n")
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            mark = MARK.match(lines[k].strip()) if k >= 0 else None
            if mark:
                block.mark, block.reason = mark.group(1), (mark.group(2) or "").strip()
            k = j + 1
            while k < len(lines) and (not lines[k].strip() or EXPECT.match(lines[k].strip())):
                e = EXPECT.match(lines[k].strip())
                if e:
                    block.expect.append(e.group(1))
                k += 1
            found.append(block)
        i = j + 1
    return found
