"""Every fact pvegpu reads runs in the C locale, read alone as much as in the batched probe
(issue 43 item 2): one reader, facts.once.read_fact, hands pyinfra `_env={"LC_ALL": "C"}`."""

from __future__ import annotations

import ast
from pathlib import Path

from pyinfra.api.command import StringCommand
from pyinfra.connectors.util import make_unix_command
from pyinfra.context import ctx_host

import facts.once
from facts.devices import NvidiaDeviceNodes

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["deploy.py", "topology.py", "facts", "operations", "plan", "compat", "spec"]


def _python_files() -> list[Path]:
    files = []
    for entry in PRODUCT:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def _get_fact_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_fact"]


def test_only_read_fact_calls_pyinfras_fact_reader():
    calls = {str(p.relative_to(ROOT)): lines for p in _python_files() if (lines := _get_fact_calls(p))}
    assert calls == {"facts/once.py": [calls.get("facts/once.py", [0])[0]]}, calls
    source = (ROOT / "facts/once.py").read_text()
    assert "host.get_fact(fact_cls, _env=FACT_ENV, **kwargs)" in source


class _Recorder:
    name = "recorder"

    def __init__(self):
        self.calls: list = []

    def get_fact(self, fact_cls, **kwargs):
        self.calls.append((fact_cls, kwargs))
        return "value"


def test_a_fact_read_alone_runs_after_an_export_of_lc_all_c():
    recorder = _Recorder()
    with ctx_host.use(recorder):
        assert facts.once.read_fact(NvidiaDeviceNodes) == "value"
    (fact_cls, kwargs), = recorder.calls
    assert fact_cls is NvidiaDeviceNodes and kwargs == {"_env": {"LC_ALL": "C"}}
    # what pyinfra then runs (connectors/util.py make_unix_command): the export comes first
    command = make_unix_command(StringCommand(NvidiaDeviceNodes().command), _env=kwargs["_env"]).get_raw_value()
    assert command.startswith("sh -c 'export LC_ALL=C && stat -c "), command
