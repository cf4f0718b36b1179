"""Incident 9's guard on the kpro6 twin (SEV-SNP, Blackwell): a GPU group switched to an identity
domain by hand stops the run in preflight, with the fix, before any change."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import manifest_diff, root_manifest, run_pyinfra

pytestmark = [pytest.mark.twin]


def test_blackwell_identity_domain_on_sev_snp_refuses_before_any_change(twin_factory):
    twin = twin_factory("kpro6", name="idom-kpro6")
    hw = Path(twin.root) / "var/lib/twin/hw/sys"
    group = Path(hw / "bus/pci/devices/0000:01:00.0/iommu_group").resolve().name
    (hw / "kernel/iommu_groups" / group / "type").write_text("identity\n")  # as `echo identity > .../type`
    upper = Path(twin.root).parent / "upper"
    before = root_manifest(upper)
    run = run_pyinfra("inventories/twin.py", "deploy.py", env={"PVEGPU_TWINS": twin.name})
    assert run.rc != 0
    assert f"GPU 0000:01:00.0 (Blackwell) is in IOMMU group {group} with an identity domain" in run.output
    assert "nothing was changed" in run.output
    assert manifest_diff(before, root_manifest(upper)) == []
