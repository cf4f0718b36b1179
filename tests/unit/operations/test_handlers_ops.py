"""operations.handlers: stages declare what a slow side effect depends on; one operation per
handler runs it once at the end of the run, initramfs before the boot loader refresh, and only
when a stage changed a file or the stamp says a previous run did not finish it."""

import subprocess

from operations import STAGES
from operations import handlers as h
from operations.files import sha256_text
from tests.unit.operations.oprun import run_op


class Data:
    def get(self, key, default=None):
        return getattr(self, key, default)


class Target:
    def __init__(self):
        self.data = Data()


def three_stages(target, changed=(True, True, True), cmdline_changed=True):
    """What boot, module options and GPU binding declare on a first converge of kpro6."""
    h.depends_on(h.BOOT_REFRESH, "/etc/kernel/cmdline", "root=ZFS=rpool amd_iommu=on\n", "644",
                 changed=cmdline_changed, why="cmdline changed", command="proxmox-boot-tool refresh", target=target)
    h.depends_on(h.INITRAMFS, "/etc/modules-load.d/pvegpu-vfio.conf", "vfio\n", "644", changed=changed[0],
                 why="vfio changed", target=target)
    h.depends_on(h.INITRAMFS, "/etc/modprobe.d/pvegpu-nvidia.conf", "options nvidia x=1\n", "644",
                 changed=changed[1], why="options changed", target=target)
    h.depends_on(h.INITRAMFS, "/etc/initramfs-tools/hooks/pvegpu-gpu-binding", "#!/bin/sh\n", "0755",
                 changed=changed[2], why="hook changed", target=target)


def stamps_of(registry):
    return {h.stamp_path(name): {"mode": "644", "sha256": sha256_text(h.stamp_text(entry["inputs"]))}
            for name, entry in registry.items()}


def test_three_stages_one_initramfs_update_then_one_refresh():
    target = Target()
    three_stages(target)
    runs = h.handler_runs(h.pending(target), {})
    assert [r["handler"] for r in runs] == [h.INITRAMFS, h.BOOT_REFRESH]  # refresh copies the new initrd
    assert runs[0]["reasons"] == ["vfio changed", "options changed", "hook changed"]
    assert runs[0]["command"] == "update-initramfs -u -k all"
    assert runs[1]["command"] == "proxmox-boot-tool refresh"
    commands = [run_op(h.run_handler, **{k: v for k, v in r.items() if k != "name"})[0] for r in runs]
    assert [len(c) for c in commands] == [1, 1]
    assert commands[0][0].startswith("update-initramfs -u -k all && ") and "/var/lib/pvegpu/initramfs.stamp" in commands[0][0]
    assert "rm -f -- /var/lib/pvegpu/gpu-binding-initramfs.stamp" in commands[0][0]  # the old GPU stage stamp goes
    assert commands[1][0].startswith("proxmox-boot-tool refresh && ") and "boot-refresh.stamp" in commands[1][0]
    # the stamp: sha256, mode and path of every file, sorted by path
    assert h.stamp_text(h.pending(target)[h.INITRAMFS]["inputs"]).splitlines()[0] == \
        f"{sha256_text('#!/bin/sh' + chr(10))} 755 /etc/initramfs-tools/hooks/pvegpu-gpu-binding"


def test_second_converge_runs_nothing():
    first = Target()
    three_stages(first)
    stamps = stamps_of(h.pending(first))  # what the first run's handlers wrote
    second = Target()
    three_stages(second, changed=(False, False, False), cmdline_changed=False)
    for run in h.handler_runs(h.pending(second), stamps):
        assert run["reasons"] == []
        commands, noop = run_op(h.run_handler, **{k: v for k, v in run.items() if k != "name"})
        assert commands == [] and "no stage changed" in (noop or "")


def test_a_run_that_stopped_before_the_update_retries_it_next_run():
    """Files written, update-initramfs never ran (or failed): the stamp still records the old files."""
    old = Target()
    three_stages(old, changed=(False, False, False), cmdline_changed=False)
    stamps = stamps_of(h.pending(old))
    now = Target()  # files on the host are already the new ones: no stage changes anything
    h.depends_on(h.INITRAMFS, "/etc/modprobe.d/pvegpu-nvidia.conf", "options nvidia x=2\n", "644",
                 changed=False, why="options changed", target=now)
    runs = h.handler_runs(h.pending(now), stamps)
    assert len(runs) == 1 and "previous run stopped" in runs[0]["reasons"][0]
    assert len(run_op(h.run_handler, **{k: v for k, v in runs[0].items() if k != "name"})[0]) == 1
    assert len(run_op(h.run_handler, **{**{k: v for k, v in runs[0].items() if k != "name"}, "reasons": []})[0]) == 1


def test_a_changed_file_runs_the_handler_even_when_the_stamp_matches():
    """An admin edited our file and rebuilt the initramfs: the stamp alone would call it current."""
    target = Target()
    three_stages(target, changed=(True, False, False), cmdline_changed=False)
    runs = h.handler_runs(h.pending(target), stamps_of(h.pending(target)))
    assert [r["reasons"] for r in runs] == [["vfio changed"], []]
    assert len(run_op(h.run_handler, **{k: v for k, v in runs[0].items() if k != "name"})[0]) == 1


def test_no_declaration_no_operation_and_unknown_handler_refused():
    assert h.handler_runs(h.pending(Target()), {}) == []
    try:
        h.depends_on("sync", "/x", "", "644", True, "x", target=Target())
    except ValueError as e:
        assert "unknown handler" in str(e)
    else:
        raise AssertionError("an unknown handler was accepted")


def test_stamp_is_written_only_when_the_side_effect_succeeded(tmp_path):
    stamp, legacy = tmp_path / "lib" / "initramfs.stamp", tmp_path / "old.stamp"
    legacy.write_text("x")
    assert subprocess.run(["sh", "-c", h.run_command("false", "a\n", str(stamp), [str(legacy)])]).returncode != 0
    assert not stamp.exists() and legacy.exists()
    assert subprocess.run(["sh", "-c", h.run_command("true", "a\n", str(stamp), [str(legacy)])]).returncode == 0
    assert stamp.read_text() == "a\n" and not legacy.exists()


def test_handlers_stage_runs_after_every_notifying_stage_and_before_the_reboot_policy():
    modules = [m for _, m in STAGES]
    assert modules.index("operations.handlers") == len(modules) - 2 and modules[-1] == "operations.reboot"


def test_depmod_first_one_command_per_release_each_quoted():
    """depmod indexes one release per call; before the initramfs (its hooks resolve modules through
    modules.dep); a release name is quoted where it lands."""
    target = Target()
    three_stages(target)
    for release in ("6.14.11-4-pve", "6.1.0-57-amd64", "x; touch $HOME"):
        h.depends_on(h.DEPMOD, f"/lib/modules/{release}/updates/pvegpu-nvidia", "nvidia 595.71.05", "755",
                     changed=True, why=f"installed for {release}", target=target)
    runs = h.handler_runs(h.pending(target), {})
    assert [r["handler"] for r in runs] == [h.DEPMOD, h.INITRAMFS, h.BOOT_REFRESH]
    assert runs[0]["command"] == "depmod -- 6.1.0-57-amd64 && depmod -- 6.14.11-4-pve && depmod -- 'x; touch $HOME'"
    assert runs[0]["name"].startswith("depmod -- 6.1.0-57-amd64 && depmod -- 6.14.11-4-pve && ")


def test_daemon_reload_last_with_its_reasons_and_a_removed_file_is_a_reason_without_input():
    target = Target()
    three_stages(target)
    h.depends_on(h.DAEMON_RELOAD, "/etc/systemd/system/pvegpu-nvidia-nodes.service", "[Unit]\n", "644",
                 changed=False, why="unit changed", target=target)
    h.notify(h.DAEMON_RELOAD, "/etc/systemd/system/old.service.d/pvegpu-nccl.conf removed", target=target)
    runs = h.handler_runs(h.pending(target), {})
    assert [r["handler"] for r in runs] == [h.INITRAMFS, h.BOOT_REFRESH, h.DAEMON_RELOAD]
    reload = runs[-1]
    assert reload["command"] == h.SYSTEMD_RELOAD and reload["name"].startswith("systemctl daemon-reload once: ")
    assert reload["reasons"] == ["/etc/systemd/system/old.service.d/pvegpu-nccl.conf removed"]
    assert reload["stamp"] == f"{sha256_text('[Unit]' + chr(10))} 644 /etc/systemd/system/pvegpu-nvidia-nodes.service\n"


def test_flush_runs_a_handler_now_and_the_end_of_run_step_not_again(monkeypatch):
    target = Target()
    ran = []
    monkeypatch.setattr(h, "run_handler", lambda **kw: ran.append(kw["command"]))
    monkeypatch.setattr(h, "fact_once", lambda fact, **kw: {})
    h.flush(h.DEPMOD, target=target)  # nothing declared: nothing runs
    assert ran == []
    h.depends_on(h.DEPMOD, "/lib/modules/6.14.11-4-pve/updates/pvegpu-nvidia", "nvidia 595.71.05", "755",
                 changed=True, why="installed", target=target)
    h.depends_on(h.INITRAMFS, "/etc/modprobe.d/pvegpu-nvidia.conf", "x\n", "644", changed=True, why="options",
                 target=target)
    h.flush(h.DEPMOD, target=target)
    assert ran == ["depmod -- 6.14.11-4-pve"]
    assert [r["handler"] for r in h.handler_runs(h.pending(target), {})] == [h.INITRAMFS]


def test_the_reason_says_whether_the_stamp_is_missing_or_records_other_files():
    target = Target()
    h.depends_on(h.INITRAMFS, "/etc/modprobe.d/pvegpu-nvidia.conf", "x\n", "644", changed=False, why="x",
                 target=target)
    (missing,) = h.handler_runs(h.pending(target), {})
    assert missing["reasons"] == ["no /var/lib/pvegpu/initramfs.stamp yet (its first run on this host, or a "
                                  "previous run stopped before it)"]
    (other,) = h.handler_runs(h.pending(target), {h.stamp_path(h.INITRAMFS): {"mode": "644", "sha256": "0" * 64}})
    assert other["reasons"] == ["/var/lib/pvegpu/initramfs.stamp records other files (a previous run stopped before it)"]
