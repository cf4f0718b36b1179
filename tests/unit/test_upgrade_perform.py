"""Issue 40 item 1: pvegpu performs the 8 -> 9 upgrade when the spec opts in
(`proxmox_ve_upgrade: perform`): the spec rule, the preflight's refusals (plan/upgrade_perform.py)
and the detached upgrade script (templates/pve-upgrade.sh.j2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spec.load import SpecError, load_spec_file

REPO = Path(__file__).resolve().parents[2]


def spec_file(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((REPO / "inventories/kpro6-pve9.yml").read_text())
    data["hosts"]["kpro6"].update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del data["hosts"]["kpro6"][key]
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump(data))
    return f


def test_perform_is_an_opt_in_and_check_the_default(tmp_path):
    assert load_spec_file(spec_file(tmp_path))["kpro6"].proxmox_ve_upgrade == "check"
    assert load_spec_file(spec_file(tmp_path, proxmox_ve_upgrade="perform"))["kpro6"].proxmox_ve_upgrade == "perform"


@pytest.mark.parametrize("major", [8, None])
def test_perform_needs_proxmox_ve_9(tmp_path, major):
    f = spec_file(tmp_path, proxmox_ve_upgrade="perform", proxmox_ve=major, kernel=None)
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    msg = str(exc.value)
    assert str(f) in msg and "kpro6" in msg and "proxmox_ve_upgrade" in msg, msg
    assert f"needs proxmox_ve: 9 (it is {major if major else 'unset'})" in msg, msg


def test_perform_is_no_free_word(tmp_path):
    with pytest.raises(SpecError, match="proxmox_ve_upgrade"):
        load_spec_file(spec_file(tmp_path, proxmox_ve_upgrade="yes"))
