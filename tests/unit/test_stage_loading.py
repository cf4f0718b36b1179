"""operations.load_stages: every stage of the run order loads; a missing one stops the run."""

from __future__ import annotations

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
