"""Nothing of a guest config lost (issue 19, part 3), on the kpro6 twin: a two-GPU move from
VM 300 to CT 200.

- ``--dry`` of the move prints the unified diff of the CT config, the VM config, pci.cfg and
  pvegpu's host files that would change, and changes nothing; its diff is true: every line it
  adds is in the file after the converge, every line it removes is gone;
- the converge keeps each Proxmox config's previous content under
  /var/lib/pvegpu/backup/<path>/<time>, byte for byte, and a backup put back by hand is the
  config as it was.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import manifest_diff
from tests.e2e.test_rebind_e2e import BDFS, Run

pytestmark = [pytest.mark.twin]

CT = "etc/pve/lxc/200.conf"
VM = "etc/pve/nodes/kpro6/qemu-server/300.conf"
PCI = "etc/pve/mapping/pci.cfg"
BINDING = "etc/udev/rules.d/60-pvegpu-gpu-binding.rules"


def diff_block(out: str, rel: str) -> list[str]:
    """The diff lines --dry printed for /rel (from its '---' header to the next header)."""
    # log_diff's lines come indented by 8 spaces (pyinfra's 4 and its own 4)
    lines = [line[8:] if line.startswith(" " * 8) else line.lstrip() for line in out.splitlines()]
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"--- /{rel} (now)")
                     or (line.startswith("--- /dev/null") and i + 1 < len(lines) and lines[i + 1].startswith(f"+++ /{rel}")))
    except StopIteration:
        raise AssertionError(f"no diff of /{rel} in:\n{out[-4000:]}") from None
    block = []
    for line in lines[start + 2:]:
        if not line.startswith(("@@", "+", "-", " ")) or line.startswith(("--- ", "+++ ")):
            break
        block.append(line)
    return block


def backups(run: Run, rel: str) -> list[str]:
    d = run.root / "var/lib/pvegpu/backup" / rel
    return [p.read_text() for p in sorted(d.iterdir())] if d.is_dir() else []


def test_dry_shows_every_diff_and_the_converge_keeps_every_config(twin_factory, tmp_path):
    twin = twin_factory("kpro6", name="bkp-move")
    run = Run(twin, tmp_path)
    rc, out, _ = run.deploy(BDFS[:4], BDFS[4:])
    assert rc == 0, out[-4000:]
    before = {rel: run.read(rel) for rel in (CT, VM, PCI, BINDING)}
    assert all(before.values())

    snapshot = run.snapshot()
    rc, dry, _ = run.deploy(BDFS[:6], BDFS[6:], "--dry")
    assert rc == 0, dry[-4000:]
    assert manifest_diff(snapshot, run.snapshot()) == [], "--dry changed the twin"
    blocks = {rel: diff_block(dry, rel) for rel in (CT, VM, PCI, BINDING)}
    assert "-hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1" in blocks[VM]
    assert "-pvegpu-kpro6-0000-81-00-0" in blocks[PCI]
    assert any(line.startswith("+dev") and "/dev/nvidia5" in line for line in blocks[CT]), blocks[CT]

    rc, out, _ = run.deploy(BDFS[:6], BDFS[6:])
    assert rc == 0, out[-4000:]
    for rel, block in blocks.items():
        now = run.read(rel).splitlines()
        added = [line[1:] for line in block if line.startswith("+")]
        removed = [line[1:] for line in block if line.startswith("-") and line[1:].strip()]
        assert all(line in now for line in added), f"/{rel}: --dry promised {added}, the file has {now}"
        assert not [line for line in removed if line in now and line not in added], \
            f"/{rel}: --dry said these go: {removed}; the file has {now}"

    assert backups(run, CT)[-1] == before[CT], "the CT config before the move was not kept"
    assert backups(run, VM)[-1] == before[VM], "the VM config before the move was not kept"
    assert before[PCI] in backups(run, PCI), "pci.cfg before the move was not kept"
    assert oct((run.root / "var/lib/pvegpu/backup").stat().st_mode)[-3:] == "700"

    # putting one back by hand, as docs/howto/restore-backup.md says: the config is what it was
    newest = sorted((run.root / "var/lib/pvegpu/backup" / CT).iterdir())[-1]
    (run.root / CT).write_bytes(newest.read_bytes())
    assert run.read(CT) == before[CT]
