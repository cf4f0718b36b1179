"""operations/backup.py: bounded backups (run here with sh on a temp dir) and the --dry diffs
of VM configs and pci.cfg (the text qm set / pvesh would leave)."""

from __future__ import annotations

import subprocess

from operations import backup
from plan.guests import MappingChange


def test_backups_keep_the_newest_n_and_the_exact_content(tmp_path):
    conf = tmp_path / "etc" / "pve" / "lxc" / "200.conf"
    conf.parent.mkdir(parents=True)
    root = tmp_path / "backup"
    for i in range(13):
        conf.write_text(f"arch: amd64\nversion: {i}\n")
        subprocess.run(["sh", "-c", backup.backup_command(str(conf), keep=10, root=str(root))], check=True)
    kept = sorted((root / str(conf).lstrip("/")).iterdir())
    assert len(kept) == 10
    assert [p.read_text().split()[-1] for p in kept] == [str(i) for i in range(3, 13)], "oldest pruned, newest kept"
    assert oct(root.stat().st_mode)[-3:] == "700"


def test_a_missing_file_is_not_backed_up_and_does_not_fail(tmp_path):
    done = subprocess.run(["sh", "-c", backup.backup_command(str(tmp_path / "nope.conf"), root=str(tmp_path / "b"))])
    assert done.returncode == 0 and not (tmp_path / "b").exists()


def test_backup_paths_are_quoted():
    cmd = backup.backup_command("/etc/pve/lxc/2 00.conf")
    assert "'/etc/pve/lxc/2 00.conf'" in cmd and "'/var/lib/pvegpu/backup/etc/pve/lxc/2 00.conf'" in cmd


VM = """\
#train box
boot: order=scsi0
hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1
hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1
machine: q35
memory: 262144

[snap1]
hostpci0: mapping=old,pcie=1
"""


def test_vm_config_after_qm_set_and_delete():
    after = backup.vm_config_after(VM, {"hostpci0": "mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1"}, ["hostpci1"])
    assert after.splitlines()[:5] == ["#train box", "boot: order=scsi0",
                                      "hostpci0: mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1", "machine: q35",
                                      "memory: 262144"]
    assert "[snap1]\nhostpci0: mapping=old,pcie=1" in after, "snapshots are untouched"
    diff = backup.diff_lines("/etc/pve/qemu-server/300.conf", VM, after)
    assert "-hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1" in diff
    assert "+hostpci0: mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1" in diff


PCI_CFG = """\
pvegpu-kpro6-0000-81-00-0
\tmap id=10de:2bb5,iommugroup=24,node=kpro6,path=0000:81:00

other
\tdescription kept
\tmap id=10de:1,node=kpro7,path=0000:01:00.0

"""


def test_pci_cfg_after_merge_delete():
    changes = [MappingChange("pvegpu-kpro6-0000-81-00-0", "delete", [], "stale"),
               MappingChange("other", "merge", [{"id": "10de:1", "node": "kpro6", "path": "0000:02:00.0"}], "moved",
                             "kpro6"),
               MappingChange("pvegpu-kpro6-0000-c1-00-0", "merge",
                             [{"id": "10de:2bb5", "node": "kpro6", "path": "0000:c1:00"}], "new", "kpro6")]
    after = backup.pci_cfg_after(PCI_CFG, changes)
    assert after == ("other\n\tmap id=10de:1,node=kpro7,path=0000:01:00.0\n\tmap id=10de:1,node=kpro6,path=0000:02:00.0\n"
                     "\tdescription kept\n\n"
                     "pvegpu-kpro6-0000-c1-00-0\n\tmap id=10de:2bb5,node=kpro6,path=0000:c1:00\n\n")


# -- issue 39 item 6: a --dry diff never prints a guest's secrets ---------------------------------

SECRET_VM = """\
#train box
args: -object secret,id=sec0,data=qemu-secret-value
boot: order=scsi0
cipassword: $5$salt$cipassword-hash-value
ciuser: ml
hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1
machine: q35

[pve:pending]
cipassword: $5$salt$pending-hash-value
"""


def test_a_vm_config_diff_masks_cipassword_and_args_in_context_and_changes():
    after = backup.vm_config_after(SECRET_VM, {"hostpci0": "mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1",
                                               "boot": "order=scsi1"}, [])
    diff = backup.diff_lines("/etc/pve/qemu-server/300.conf", SECRET_VM, after)
    text = "\n".join(diff)
    assert "cipassword-hash-value" not in text and "qemu-secret-value" not in text, text
    assert " cipassword: **********" in diff and " args: **********" in diff  # context lines
    assert "+hostpci0: mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1" in diff and " ciuser: ml" in diff
    changed = backup.diff_lines("/etc/pve/qemu-server/300.conf", SECRET_VM,
                                SECRET_VM.replace("cipassword-hash-value", "other"))
    assert "-cipassword: **********" in changed and "+cipassword: **********" in changed, "a change still shows"
    assert "pending-hash-value" not in "\n".join(changed)


def test_a_container_diff_masks_its_environment():
    ct = "arch: amd64\nenv: HF_TOKEN=hf_secret\nlxc.environment: WANDB_API_KEY=wandb_secret\nmemory: 4096\n"
    diff = backup.diff_lines("/etc/pve/lxc/200.conf", ct, ct.replace("memory: 4096", "memory: 8192")
                             + "#lxc.environment.runtime%3A OLD=old_secret\n")
    text = "\n".join(diff)
    assert not any(s in text for s in ("hf_secret", "wandb_secret", "old_secret")), text
    assert " env: **********" in diff and " lxc.environment: **********" in diff
    assert "+#lxc.environment.runtime%3A **********" in diff and "+memory: 8192" in diff


def test_the_dry_log_of_a_vm_config_shows_no_secret(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(backup, "logger", type("L", (), {"info": staticmethod(said.append)}))
    monkeypatch.setattr(backup, "host", type("H", (), {"name": "kpro6"}))
    after = backup.vm_config_after(SECRET_VM, {"machine": "q35", "hostpci1": "mapping=x,pcie=1"}, [])
    backup.log_diff("/etc/pve/qemu-server/300.conf", SECRET_VM, after)
    assert said and "cipassword: **********" in "\n".join(said)
    assert "cipassword-hash-value" not in "\n".join(said) and "qemu-secret-value" not in "\n".join(said)


def test_host_files_are_not_masked():
    diff = backup.diff_lines("/etc/nccl.conf", "args: a\n", "args: b\n")
    assert "-args: a" in diff and "+args: b" in diff
