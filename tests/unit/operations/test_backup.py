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
