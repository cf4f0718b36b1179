"""compat.pyinfra_speedups: the same operation order as pyinfra's own function."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pyinfra
import pytest

from compat import pyinfra_speedups as speedups


def _nested(fn, depth):
    return fn() if depth == 0 else _nested(fn, depth - 1)


@pytest.mark.parametrize("is_cli", [False, True])
@pytest.mark.parametrize("deploy_file", [__file__, "/nowhere/deploy.py", None])
def test_same_line_numbers_as_upstream(monkeypatch, is_cli, deploy_file):
    monkeypatch.setattr(pyinfra, "is_cli", is_cli)
    state = SimpleNamespace(current_deploy_filename=deploy_file, current_op_file_number=7)
    # both called from the same line, through the same frames
    upstream, ours = [_nested(lambda f=f: f(state), 4) for f in (speedups.ORIGINAL, speedups.operation_order_from_stack)]
    assert ours == upstream
    if deploy_file == __file__:
        assert len(ours) >= 6  # this file's frames, after the first one from it


def test_install_patches_the_operation_module_once(monkeypatch):
    operation = importlib.import_module("pyinfra.api.operation")
    monkeypatch.setattr(operation, "get_operation_order_from_stack", speedups.ORIGINAL)
    monkeypatch.delenv("PVEGPU_PYINFRA_SPEEDUPS", raising=False)
    assert speedups.install() is True
    assert operation.get_operation_order_from_stack is speedups.operation_order_from_stack
    assert speedups.install() is False  # already replaced: nothing more to do


def test_install_can_be_turned_off(monkeypatch):
    operation = importlib.import_module("pyinfra.api.operation")
    monkeypatch.setattr(operation, "get_operation_order_from_stack", speedups.ORIGINAL)
    monkeypatch.setenv("PVEGPU_PYINFRA_SPEEDUPS", "0")
    assert speedups.install() is False
    assert operation.get_operation_order_from_stack is speedups.ORIGINAL


def test_global_arguments_equal_upstream_and_are_a_fresh_list():
    assert speedups.ORIGINAL_ARGUMENTS is not None
    upstream = speedups.ORIGINAL_ARGUMENTS()
    assert speedups.global_arguments() == upstream
    assert len(upstream) > 10 and "_sudo" in dict(upstream)
    first = speedups.global_arguments()
    first.clear()  # a caller changing its list changes nobody else's
    assert speedups.global_arguments() == upstream


def test_install_patches_the_arguments_module(monkeypatch):
    arguments = importlib.import_module("pyinfra.api.arguments")
    operation = importlib.import_module("pyinfra.api.operation")
    monkeypatch.setattr(arguments, "all_global_arguments", speedups.ORIGINAL_ARGUMENTS)
    monkeypatch.setattr(operation, "get_operation_order_from_stack", speedups.ORIGINAL)
    monkeypatch.delenv("PVEGPU_PYINFRA_SPEEDUPS", raising=False)
    assert speedups.install() is True
    assert arguments.all_global_arguments is speedups.global_arguments
    # pop_global_arguments (which looks the function up in its module) gives what it gave before
    from pyinfra.api.arguments import pop_global_arguments
    from pyinfra.api.config import Config
    from pyinfra.api.inventory import Inventory
    from pyinfra.api.state import State
    from pyinfra.context import ctx_state

    state = State(Inventory((["somehost"], {})), Config())
    somehost = state.inventory.get_host("somehost")
    with ctx_state.use(state):
        kwargs = {"_sudo": True, "other": 1}
        ours = pop_global_arguments(state, somehost, kwargs)
        assert kwargs == {"other": 1}
        monkeypatch.setattr(arguments, "all_global_arguments", speedups.ORIGINAL_ARGUMENTS)
        theirs = pop_global_arguments(state, somehost, {"_sudo": True, "other": 1})
    assert ours == theirs and ours[0]["_sudo"] is True


def test_gate_passes_on_the_pinned_pyinfra():
    # the pinned pyinfra (pyproject.toml) is the one the speedups were written for
    assert pyinfra.__version__ == speedups.WRITTEN_FOR
    assert speedups.gate_refusal() is None


def test_gate_refuses_another_release_and_other_code():
    assert "3.11.0" in (speedups.gate_refusal(version="3.11.0") or "")

    def get_operation_order_from_stack(state):  # same name, other code
        return []

    refusal = speedups.gate_refusal(originals={"get_operation_order_from_stack": get_operation_order_from_stack,
                                               "all_global_arguments": speedups.ORIGINAL_ARGUMENTS})
    assert refusal and "get_operation_order_from_stack" in refusal
    assert "no all_global_arguments" in (speedups.gate_refusal(originals={"all_global_arguments": None}) or "")


def test_refused_gate_runs_stock_pyinfra_and_logs_once(monkeypatch, caplog):
    operation = importlib.import_module("pyinfra.api.operation")
    arguments = importlib.import_module("pyinfra.api.arguments")
    monkeypatch.setattr(operation, "get_operation_order_from_stack", speedups.ORIGINAL)
    monkeypatch.setattr(arguments, "all_global_arguments", speedups.ORIGINAL_ARGUMENTS)
    monkeypatch.delenv("PVEGPU_PYINFRA_SPEEDUPS", raising=False)
    monkeypatch.setattr(pyinfra, "__version__", "9.9.9")
    monkeypatch.setattr(speedups, "_gate_logged", False)
    with caplog.at_level("WARNING", logger="pvegpu"):
        assert speedups.install() is False
        assert speedups.install() is False
    assert operation.get_operation_order_from_stack is speedups.ORIGINAL
    assert arguments.all_global_arguments is speedups.ORIGINAL_ARGUMENTS
    said = [r.getMessage() for r in caplog.records if "speedups off" in r.getMessage()]
    assert len(said) == 1 and "9.9.9" in said[0]
