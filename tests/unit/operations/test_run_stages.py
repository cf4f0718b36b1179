"""operations.run_stages: two stages' operations that sit on the same line of their own modules
stay two operations for pyinfra, also across hosts of one run (a cluster run stopped with
"Cannot have different values for `_serial`" when one node's guest operation and another node's
rolling reboot were both on line 412 of their modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pyinfra
import pytest
from pyinfra.api.config import Config
from pyinfra.api.exceptions import OperationValueError
from pyinfra.api.inventory import Inventory
from pyinfra.api.state import State, StateStage
from pyinfra.context import ctx_host, ctx_state

from operations import run_stages

PAD = "\n" * 8  # the same lines before each stage's operation

STAGE = '''"""a stage with one operation"""
from pyinfra import host
from pyinfra.operations import server
ONLY_ON = {only!r}
KWARGS = {kwargs!r}''' + PAD + '''def apply(spec):
    host.name == ONLY_ON and server.shell(name={name!r}, commands=["true"], **KWARGS)
'''

OLD_LOOP = "for _name, module in stages:\n    module.apply(spec)\n"
NEW_LOOP = "run_stages(host, stages, 'apply', spec)\n"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state(deploy: Path) -> State:
    """Two hosts, planning as the CLI does (operations are added, not run)."""
    state = State(Inventory((["h1", "h2"], {})), Config())
    state.set_stage(StateStage.Prepare)
    state.current_deploy_filename = str(deploy)
    return state


def _plan(tmp_path: Path, monkeypatch, loop: str) -> State:
    """Two hosts; stage `guests` adds its operation on h1 only, stage `reboot` on h2 only, with
    `_serial` (as the rolling reboot does); both on the same line of their modules."""
    (tmp_path / "st_guests.py").write_text(STAGE.format(only="h1", kwargs={}, name="guests: VM 300 GPUs"))
    (tmp_path / "st_reboot.py").write_text(STAGE.format(only="h2", kwargs={"_serial": True}, name="Reboot"))
    lines = {[n for n, line in enumerate(path.read_text().splitlines(), 1) if "server.shell(" in line][0]
             for path in tmp_path.glob("st_*.py")}
    assert len(lines) == 1, "both operations on one line number of their modules"
    stages = [("guests", _module(tmp_path / "st_guests.py")), ("reboot", _module(tmp_path / "st_reboot.py"))]
    deploy = tmp_path / "deploy.py"
    deploy.write_text(loop)
    code = compile(deploy.read_text(), str(deploy), "exec")
    monkeypatch.setattr(pyinfra, "is_cli", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    state = _state(deploy)
    for name in ("h1", "h2"):
        host = state.inventory.get_host(name)
        with ctx_state.use(state), ctx_host.use(host):
            exec(code, {"host": host, "stages": stages, "spec": None, "run_stages": run_stages})
    return state


def test_stages_operations_on_equal_lines_stay_apart_across_hosts(tmp_path, monkeypatch):
    state = _plan(tmp_path, monkeypatch, NEW_LOOP)
    hashes = {name: state.inventory.get_host(name).op_hash_order for name in ("h1", "h2")}
    assert len(hashes["h1"]) == 1 and len(hashes["h2"]) == 1
    assert hashes["h1"] != hashes["h2"], "two operations, two hashes"
    metas = [state.op_meta[h[0]] for h in hashes.values()]
    assert [sorted(m.names) for m in metas] == [["guests: VM 300 GPUs"], ["Reboot"]]
    assert metas[1].global_arguments["_serial"] is True and metas[0].global_arguments["_serial"] is False


def test_the_plain_loop_merges_them_and_pyinfra_refuses(tmp_path, monkeypatch):
    """What deploy.py did before: both operations get one hash and the run stops."""
    with pytest.raises(OperationValueError, match="_serial"):
        _plan(tmp_path, monkeypatch, OLD_LOOP)


def test_one_stage_shares_its_hash_across_hosts(tmp_path, monkeypatch):
    """The same stage's operation on every host stays one pyinfra operation (run together,
    `_serial` batches over it)."""
    (tmp_path / "st_both.py").write_text(STAGE.format(only="h1", kwargs={"_serial": True}, name="Reboot")
                                         .replace("host.name == ONLY_ON and ", ""))
    stages = [("reboot", _module(tmp_path / "st_both.py"))]
    deploy = tmp_path / "deploy.py"
    deploy.write_text(NEW_LOOP)
    monkeypatch.setattr(pyinfra, "is_cli", True)
    state = _state(deploy)
    for name in ("h1", "h2"):
        host = state.inventory.get_host(name)
        with ctx_state.use(state), ctx_host.use(host):
            exec(compile(NEW_LOOP, str(deploy), "exec"), {"host": host, "stages": stages, "spec": None,
                                                          "run_stages": run_stages})
    h1, h2 = (state.inventory.get_host(n).op_hash_order for n in ("h1", "h2"))
    assert h1 == h2 and len(h1) == 1


def test_a_stage_without_the_method_is_skipped(tmp_path, monkeypatch):
    calls = []
    mod = type(sys)("m")
    mod.after_reboot = lambda spec: calls.append(spec)  # type: ignore[attr-defined]
    bare = type(sys)("bare")
    host = type("H", (), {"loop": lambda self, it: iter(it)})()
    run_stages(host, [("a", bare), ("b", mod)], "after_reboot", "spec")
    assert calls == ["spec"]
