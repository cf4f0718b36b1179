"""operations.load_stages: every stage of the run order loads; a missing one stops the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from operations import STAGES, MissingStage, load_stages


def test_every_stage_loads_in_order_with_an_apply():
    loaded = load_stages()
    assert [name for name, _ in loaded] == [name for name, _ in STAGES]
    assert all(callable(module.apply) for _, module in loaded)


def test_a_misspelt_stage_is_refused_by_name():
    with pytest.raises(MissingStage, match=r"stage 'kernel': module operations\.kernal does not exist"):
        load_stages([("host kernel & IOMMU", "operations.boot"), ("kernel", "operations.kernal")])


def test_a_module_without_apply_is_refused():
    with pytest.raises(MissingStage, match=r"operations\.files has no apply"):
        load_stages([("files", "operations.files")])


def test_an_import_error_inside_a_stage_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "brokenstage.py").write_text("import no_such_module_anywhere\ndef apply(spec): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_module_anywhere"):
        load_stages([("broken", "brokenstage")])


def test_the_guest_shutdown_timeout_default_lives_in_the_model_only():
    import inspect
    import re

    from group_data.all import PVEGPU_DEFAULTS
    from operations import guests
    from operations.gpus import SHUTDOWN_TIMEOUT_S
    from spec.models import GuestPolicy

    assert SHUTDOWN_TIMEOUT_S == GuestPolicy().shutdown_timeout
    assert "shutdown_timeout" not in PVEGPU_DEFAULTS["guests"]
    for fn in (guests.container_gpu_devices, guests.vm_hostpci):
        assert inspect.signature(fn).parameters["shutdown_timeout"].default == SHUTDOWN_TIMEOUT_S
    for module in ("operations/gpus.py", "operations/guests.py"):
        text = open(module).read()
        assert not re.search(r"shutdown_timeout: int = \d", text), f"{module} writes its own default"


def test_the_container_device_gid_default_lives_in_the_model_only():
    """Before: 44 in group_data (as unvalidated host data PVEGPU_DEVICE_GID), again in
    operations/guests.py, and None in the model; a host-data value bypassed the spec's checks."""
    import ast

    import group_data.all as group_data
    from spec.models import ContainerSpec

    assert ContainerSpec().gid == 44
    assert not hasattr(group_data, "PVEGPU_DEVICE_GID")
    for module in sorted((Path(__file__).resolve().parents[2] / "operations").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            # host.data.get("KEY"): the only host data an operation may read is what spec.load sets
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "data":
                key = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                assert key in {"pvegpu_node", "pvegpu_spec"}, f"{module}:{node.lineno} reads host data {key!r} outside the spec"
