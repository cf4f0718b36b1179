"""compat.gc_after_planning: deploy.py's last statement freezes what the run has made, so the
collections at exit (and later ones) skip it."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
from pathlib import Path

from compat.gc_after_planning import keep_planned_objects

REPO = Path(__file__).resolve().parents[2]


def test_the_objects_made_before_are_frozen_and_later_ones_are_not():
    gc.unfreeze()
    try:
        made = [[i] for i in range(1000)]
        keep_planned_objects()
        frozen = gc.get_freeze_count()
        assert frozen >= len(made)
        later = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen, "objects made after it are collected as usual"
        del later
    finally:
        gc.unfreeze()


def test_deploy_py_ends_with_it():
    tree = ast.parse((REPO / "deploy.py").read_text())
    last = tree.body[-1]
    assert isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
    assert isinstance(last.value.func, ast.Name) and last.value.func.id == "keep_planned_objects"


def test_a_process_that_froze_its_objects_exits_with_its_output_flushed(tmp_path):
    """What the run prints and writes still comes out at exit (the streams are flushed by the
    interpreter, not by the collector)."""
    out = tmp_path / "f.txt"
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from compat.gc_after_planning import keep_planned_objects\n"
            f"f = open({str(out)!r}, 'w'); f.write('kept'); a = [1]; a.append(a)\n"
            "keep_planned_objects(); print('printed', end='')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "printed" and out.read_text() == "kept"
