"""A real `apt full-upgrade` from Proxmox VE 8 (bookworm) to 9 (trixie) on a kpro6 twin (issue 40 item 4).

The twin runs 8 on 6.8.12-11-pve with nvidia 595.71.05; the NVIDIA stage and the kernel hook stage
converge it (the hook /etc/kernel/postinst.d/00pvegpu-nvidia and apt's DPkg::Post-Invoke are
installed, proxmox-default-headers with them). Then the upgrade guide's steps, for real: the apt
sources move from bookworm to trixie in their own formats, `apt full-upgrade` runs unattended with
Debian's packages from Debian's archive (cached: tests/twin/distupgrade.py) and Proxmox's from a
local repository in their real shapes (proxmox-ve, pve-manager, proxmox-default-kernel ->
proxmox-kernel-X.Y -> proxmox-kernel-<rel>-signed, whose postinst runs /etc/kernel/postinst.d, and
proxmox-kernel-helper 9.2.0 built from its source): dpkg's own order decides when pvegpu's hook runs
for 9's kernel. Asserted: dpkg ends clean, the host's user space is trixie and pve-manager 9, the
hook ran inside the transaction for 9's kernel, and when apt returns (no converge in between) 9's
kernel has nvidia built with GCC 14 (its .comment), by the hook in the kernel's postinst or, where
gcc-14 was not configured yet, by its pass after the dpkg run; in no case is an 8 kernel the loader's default of the 9 system
(proxmox-boot-tool's pin, the ESP's loader.conf default, the EFI variable LoaderEntryDefault);
then pvegpu's upgrade check (--dry, `proxmox_ve: 9`) reports what is still due on 9.

test_one_deploy_performs_the_upgrade: the same upgrade done by pvegpu itself, one full deploy with
`proxmox_ve_upgrade: perform` starting the job (the setsid path: the twin runs no systemd), then the
reboot into 9's kernel, a converge, the host checks and a run without changes, with a GPU CT
stopped for the upgrade and started again on 9 (235 s on 2026-12-06; 186-356 s without the CT,
by the machine's load).

test_two_cluster_nodes_in_turn: the same for two nodes of a three-node cluster twin, in turn (issue
40 item 2): each run one full deploy over the three nodes (the third a member that does not
upgrade: quorum lets one node of three reboot); one node starts, the other waits naming it, then
waits for its reboot into 9's kernel and its host checks there (`checked=`), starts, and is taken
to 9 the same way; the two jobs never overlap, a converge and a run without changes end it (201 s
and 191 s, pytest's totals, the jobs 57-69 s each, on 2026-12-06 22:53 and 23:01 UTC).

The slow lane (`make test-slow`; scripts/run-tests.sh leaves it out): ~3-10 min warm on 2
busy cores (2026-12-06: 558 s and 462 s for two cases, the full-upgrade alone 412-483 s; later
that day 150 s, the full-upgrade 108 s, on a quieter machine), the first run also downloads ~300
.debs (~400 MB) into .cache/distup/.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pytest

from tests.e2e import power_cut as pc
from tests.e2e import test_kernel_upgrade_e2e as ku
from tests.e2e.harness import REPO, run_pyinfra, spec_inventory
from tests.twin import distupgrade as du
from tests.twin import hardware, runtime

pytestmark = [pytest.mark.twin, pytest.mark.slow]

NAME = "s17-distup"
OLD_KERNEL = "6.8.12-11-pve"
PROFILE_8 = f"""extends: kpro6
name: s17-kpro6-8
kernel: {{release: {OLD_KERNEL}, version: '#1 SMP PREEMPT_DYNAMIC PMX 6.8.12-11 (2025-05-22T09:39Z)', installed: [{OLD_KERNEL}]}}
"""
VERSION = "595.71.05"
ARCHIVE = f"/opt/src/open-gpu-kernel-modules-{VERSION}.tar.gz"
STAGE_DEPLOY = str(REPO / "tests/e2e/stage_deploy.py")
STAGES = {"PVEGPU_STAGES": "operations.nvidia,operations.kernel_hook"}
HOOK_DIR = "var/lib/pvegpu/kernel-hook"


def host_spec(sha: str, pve: int | None, node: str = "kpro6", **more) -> dict:
    nvidia = {"version": VERSION, "open": True, "modules_source": {"url": f"file://{ARCHIVE}", "sha256": sha},
              "firmware": False, "persistenced": False}
    return {"node": node, "kernel_updates": "follow", "nvidia": nvidia, **({"proxmox_ve": pve} if pve else {}),
            **more}


def write_inventory(tmp: Path, twin, sha: str, pve: int | None, node: str = "kpro6", **more) -> str:
    return spec_inventory(tmp, twin, host_spec(sha, pve, node, **more), f"distup-{pve or 8}{'-perform' if more else ''}")


def loader_defaults(root: Path) -> dict:
    """What decides the kernel the twin's systemd-boot host boots next: proxmox-boot-tool's pin,
    the EFI variable LoaderEntryDefault and the entry the twin's systemd-boot model starts
    (tests/twin/hardware.py esp_boot_entry: one-shot, LoaderEntryDefault, loader.conf default)."""
    pin = root / "etc/kernel/proxmox-boot-pin"
    entry = hardware.esp_boot_entry(root)
    return {"pin": pin.read_text().strip() if pin.exists() else None,
            "LoaderEntryDefault": hardware._efivar(root, "LoaderEntryDefault", False),
            "boots": entry["file"] if entry else None}


# 8's kernel has headers whose CONFIG_CC_VERSION_TEXT names gcc-12, as Proxmox's 8 kernels are built
# (bookworm's gcc-12; here Debian's real 6.1.0-57-amd64 headers of the twin root, linked as
# 6.8.12-11-pve's build tree): the converge builds with gcc-12 there. The hook carries no compiler:
# for 9's kernel it takes that kernel's own (trixie's gcc-14/g++-14, templates/nvidia-toolchain-pick.sh.j2),
# inside the transaction where dpkg has configured them by then, else in apt's DPkg::Post-Invoke pass
# after the dpkg run (issue 40: a hook rendered with gcc-12 left 9's kernel without modules).
def prepare(twin_factory, tmp_path, monkeypatch, name: str = NAME, cluster: str | None = None,
            profile: str = PROFILE_8) -> dict:
    """The twin on 8 converged (the NVIDIA and kernel hook stages), Proxmox's 8 and 9 packages in the
    local repository, Debian's trixie indexes and .debs in the twin's apt cache; the sources named
    trixie (the upgrade guide's step: test_real_dist_upgrade_8_to_9 runs apt itself next).
    `cluster`: the twin is a node of that cluster twin, its Proxmox node name (and host name) its
    twin's name; one `tmp_path` per twin (the profile, inventories and .debs are written there)."""
    t0 = time.monotonic()
    (tmp_path / "p8.yml").write_text(profile)
    twin = twin_factory(str(tmp_path / "p8.yml"), name=name, cluster=cluster)
    node = name if cluster else "kpro6"
    root = Path(twin.root)
    du.sh(twin, f"ln -sfn /usr/src/linux-headers-6.1.0-57-amd64 /lib/modules/{OLD_KERNEL}/build")
    monkeypatch.setattr(ku, "VERSION", VERSION)
    archive = ku.mini_tree(tmp_path)
    (root / "opt/src").mkdir(parents=True, exist_ok=True)
    (root / ARCHIVE.lstrip("/")).write_bytes(archive.read_bytes())
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()

    # Proxmox VE 8 from the local repository: proxmox-ve and pve-manager with their relations
    # (the twin's stanzas carry none), proxmox-default-kernel on 6.8
    du.use_local_pve_repo(twin, "bookworm")
    du.publish(twin, du.pve_debs(tmp_path / "debs-8", "bookworm", OLD_KERNEL, "6.8.12-11", None), "bookworm")
    du.update_local(twin)
    du.sh(twin, f"{du.APT_ENV} apt-get -q -y install --reinstall proxmox-ve pve-manager")
    du.sh(twin, f"{du.APT_ENV} apt-get -q -y install proxmox-default-kernel")
    inv8 = write_inventory(tmp_path, twin, sha, None, node)
    first = run_pyinfra(inv8, STAGE_DEPLOY, env=STAGES, timeout=900)
    assert first.rc == 0, first.output[-6000:]
    hook_script = (root / "etc/kernel/postinst.d/00pvegpu-nvidia").read_text()
    assert "pick_toolchain" in hook_script and "gcc-12" not in hook_script  # no compiler of 8's in it
    assert "proxmox-default-headers install ok installed" in du.sh(
        twin, "dpkg-query -W -f '${Package} ${Status}\\n' proxmox-default-headers").stdout
    t_8 = time.monotonic() - t0

    # the upgrade guide: sources to trixie in their formats, the indexes and packages (cached)
    du.move_sources(twin)
    assert "Suites: trixie trixie-updates" in (root / "etc/apt/sources.list.d/debian.sources").read_text()
    assert (root / du.PVE_LIST).read_text().split()[-2:] == ["trixie", du.COMPONENT]
    cache = du.cache_dir()
    du.publish(twin, [], "trixie")  # the local suite's index, empty until 9's kernel is known
    lists = du.fetch_lists(twin, cache)
    new, new_version = du.trixie_kernel(twin)
    debs = du.pve_debs(tmp_path / "debs-9", "trixie", new, new_version,
                       du.image_files(new, ""), headers_depends=f"linux-headers-{new}")
    debs.append(du.helper_deb(twin))
    du.publish(twin, debs, "trixie")
    du.update_local(twin)
    downloaded = du.fetch_debs(twin, cache)
    # the image carries the kernel's real config (from Debian's headers package, now in the apt cache)
    debs[debs.index(next(d for d in debs if d.name.startswith(f"proxmox-kernel-{new}-signed")))] = \
        du.image(tmp_path / "debs-9", new, new_version, du.image_files(new, du.kernel_config(twin, new)))
    du.publish(twin, debs, "trixie")
    du.update_local(twin)
    t_fetch = time.monotonic() - t0 - t_8
    return {"t0": t0, "t_8": t_8, "t_fetch": t_fetch, "twin": twin, "root": root, "sha": sha, "new": new,
            "lists": lists, "downloaded": downloaded, "node": node}


def test_real_dist_upgrade_8_to_9(twin_factory, tmp_path, monkeypatch):
    p = prepare(twin_factory, tmp_path, monkeypatch)
    t0, t_8, t_fetch, twin, root, sha, new = (p["t0"], p["t_8"], p["t_fetch"], p["twin"], p["root"], p["sha"],
                                              p["new"])
    lists, downloaded = p["lists"], p["downloaded"]
    log = tmp_path / "full-upgrade.log"
    done = du.full_upgrade(twin, log)
    t_upgrade = time.monotonic() - t0 - t_8 - t_fetch
    print(f"timings: 8 converge {t_8:.0f} s, fetch ({lists} lists, {downloaded} .debs downloaded) {t_fetch:.0f} s, "
          f"full-upgrade {t_upgrade:.0f} s; log {log}")
    out = log.read_text()
    keep = REPO / ".cache" / "distup" / "last-full-upgrade.log"  # for the reader of a failure
    keep.write_text(out)
    assert done.returncode == 0, out[-8000:]
    runtime.kill_sshd(NAME)  # the listener of 8's sshd cannot serve 9's sshd-session: restarted, as the unit would
    assert du.sh(twin, "dpkg --audit").stdout.strip() == ""
    assert du.sh(twin, ". /etc/os-release && echo $VERSION_CODENAME").stdout.strip() == "trixie"
    assert du.sh(twin, "dpkg-query -W -f '${Version}' pve-manager").stdout == du.PVE["trixie"]["pve-manager"]

    # the hook ran inside the transaction for 9's kernel: built or deferred, with its reason
    hook = root / HOOK_DIR
    hook_log = (hook / f"{new}.log").read_text() if (hook / f"{new}.log").exists() else None
    assert hook_log is not None, out[-8000:]
    order = [m for m in re.findall(r"^Setting up (\S+) ", out, re.M)]
    print("hook log:\n" + hook_log)
    print("order:", [p for p in order if p.startswith(("base-files", "gcc-14", "gcc ", "linux-headers", "proxmox-"))])
    # it ran from the image's postinst (run-parts of /etc/kernel/postinst.d), not only after dpkg
    assert re.search(rf"^Setting up proxmox-kernel-{re.escape(new)}-signed .*?^run-parts: executing "
                     rf"/etc/kernel/postinst.d/00pvegpu-nvidia {re.escape(new)}", out, re.M | re.S), out[-8000:]
    # built with trixie's gcc-14 and g++-14 before apt returned, no converge in between: by the
    # kernel's postinst (gcc-14 configured by then) or by apt's pass after the dpkg run
    deferred = "is unpacked but not yet configured" in out
    print("built", "by apt's DPkg::Post-Invoke pass (gcc-14 was not configured when the kernel's postinst ran)"
          if deferred else "inside the transaction")
    assert (hook / f"{new}.ok").exists() and not (hook / f"{new}.failed").exists(), hook_log
    assert not (hook / f"{new}.no-compiler").exists()
    assert f"building nvidia {VERSION} for {new} with gcc-14 and g++-14" in hook_log, hook_log
    ko = f"/lib/modules/{new}/updates/pvegpu-nvidia/nvidia.ko"
    comment = du.sh(twin, f"readelf -p .comment {ko}").stdout
    assert "14.2.0" in comment and "12.2.0" not in comment, comment
    assert du.sh(twin, f"modinfo -k {new} -F version nvidia").stdout.strip() == VERSION
    assert du.sh(twin, f"modinfo -F vermagic {ko}").stdout.split()[0] == new

    # never an 8 kernel as the 9 system's default
    defaults = loader_defaults(root)
    print("loader:", defaults)
    assert defaults["pin"] in (None, new), defaults
    assert OLD_KERNEL not in (defaults["LoaderEntryDefault"] or ""), defaults
    assert defaults["boots"] == f"proxmox-{new}.conf", defaults

    # pvegpu's upgrade check after the upgrade: what is still due
    inv9 = write_inventory(tmp_path, twin, sha, 9)
    dry = run_pyinfra(inv9, "deploy.py", "--dry", timeout=900)
    print(dry.output[-6000:])
    assert "upgrade check: the host runs Proxmox VE 9.2.11 now (proxmox_ve: 9); still due after the upgrade" \
        in dry.output, dry.output[-6000:]
    assert "Fix now (the host runs 9): apt remove systemd-boot" in dry.output
    print(f"total {time.monotonic() - t0:.0f} s")


PERFORM_NAME = "s21-distup"
STATE = "var/lib/pvegpu/upgrade"


def test_one_deploy_performs_the_upgrade(twin_factory, tmp_path, monkeypatch):
    """The whole 8 -> 9 upgrade by pvegpu (issue 40: `proxmox_ve: 9` + `proxmox_ve_upgrade: perform`):
    the twin prepared as above (8 converged; the local repository and the apt cache hold 8's and 9's
    packages), its sources back on bookworm; then ONE full `pyinfra <inventory> deploy.py` starts the
    detached job (the twin runs no systemd: the job is the setsid'd process of
    templates/pve-upgrade-start.sh.j2, not a `systemd-run` unit), which moves the sources and runs the
    real `apt-get full-upgrade`; a run meanwhile reports it running and changes nothing; the next run
    (reboot.allowed) converges on 9 and reboots into 9's kernel, which comes up with nvidia.version's
    modules built by GCC 14 (by the hook inside the job's transaction) and starts again the GPU CT the
    start stopped (its record, guests-stopped, then removed); a converge, the host checks
    (nvidia_driver), and a last run without changes. The resolver is this machine's while the job
    runs (its `apt-get update`)."""
    p = prepare(twin_factory, tmp_path, monkeypatch, name=PERFORM_NAME)
    t0, twin, root, sha, new = p["t0"], p["twin"], p["root"], p["sha"], p["new"]
    du.move_sources(twin, "trixie", "bookworm")  # the host as it is before the upgrade: the job moves them
    assert (root / du.PVE_LIST).read_text().split()[-2:] == ["bookworm", du.COMPONENT]
    # a running CT with a GPU: the start stops it and records it; the run on 9's kernel starts it again
    inv = write_inventory(tmp_path, twin, sha, 9, proxmox_ve_upgrade="perform", reboot={"allowed": True},
                          gpus={"0000:01:00.0": "lxc", "0000:81:00.0": "vm:300"},
                          containers={200: {"gpus": ["0000:01:00.0"]}},
                          vms={300: {"gpus": ["0000:81:00.0"], "machine": "q35"}},
                          iommu={"vendor": "amd", "passthrough": False, "params": ["pci=realloc"]},
                          guests={"allow_stop": True})
    du.sh(twin, "pct start 200")
    du.sh(twin, "qm start 300")
    record = root / STATE / "guests-stopped"
    state = root / STATE / "state"

    def status() -> str:
        return state.read_text() if state.exists() else ""

    t_start = time.monotonic()
    with du.Network(twin):
        started = run_pyinfra(inv, "deploy.py", timeout=900)
        assert started.rc == 0, started.output[-6000:]
        assert "the Proxmox VE 8 -> 9 upgrade starts detached on the host" in started.output, started.output[-4000:]
        assert "status=running" in status() or "status=done" in status(), status()
        assert record.read_text() == "lxc 200\nqemu 300\n" and "status: stopped" in du.sh(twin, "pct status 200").stdout
        assert "status: stopped" in du.sh(twin, "qm status 300").stdout
        # a run while the job runs: reported, the run stops
        running = run_pyinfra(inv, "deploy.py", timeout=900)
        assert running.rc != 0 and "the 8 -> 9 upgrade runs on the host" in running.output, running.output[-4000:]
        assert "status=running" in status(), status()  # still running after that run (minutes of apt)
        deadline = time.monotonic() + 2400
        while "status=running" in status() and time.monotonic() < deadline:
            time.sleep(2)
    t_job = time.monotonic() - t_start
    log = (root / STATE / "upgrade.log").read_text()
    (REPO / ".cache" / "distup" / "last-perform.log").write_text(log)
    assert "status=done" in status(), status() + log[-8000:]
    runtime.kill_sshd(PERFORM_NAME)  # 8's sshd listener cannot serve 9's sshd-session (as in the test above)
    assert du.sh(twin, "dpkg --audit").stdout.strip() == ""
    assert du.sh(twin, ". /etc/os-release && echo $VERSION_CODENAME").stdout.strip() == "trixie"
    assert du.sh(twin, "dpkg-query -W -f '${Version}' pve-manager").stdout == du.PVE["trixie"]["pve-manager"]
    assert (root / du.PVE_LIST).read_text().split()[-2:] == ["trixie", du.COMPONENT]  # moved by the job
    hook = root / HOOK_DIR
    assert (hook / f"{new}.ok").exists(), log[-8000:]

    # the next run: converged on 9, rebooted into 9's kernel (reboot.allowed)
    with pc.Operator(PERFORM_NAME):
        rebooted = run_pyinfra(inv, "deploy.py", timeout=1200)
    assert rebooted.rc == 0, rebooted.output[-6000:]
    assert du.sh(twin, "uname -r").stdout.strip() == new, rebooted.output[-4000:]
    ko = f"/lib/modules/{new}/updates/pvegpu-nvidia/nvidia.ko"
    comment = du.sh(twin, f"readelf -p .comment {ko}").stdout
    assert "14.2.0" in comment and "12.2.0" not in comment, comment
    assert pc.gpu_driver(PERFORM_NAME) == VERSION, rebooted.output[-4000:]
    # the CT pvegpu stopped for the upgrade runs again, once: the record is gone
    assert "status: running" in du.sh(twin, "pct status 200").stdout, rebooted.output[-4000:]
    assert "status: running" in du.sh(twin, "qm status 300").stdout, rebooted.output[-4000:]
    assert re.search(r"^hostpci0: ", du.sh(twin, "cat /etc/pve/qemu-server/300.conf").stdout, re.M)  # its GPU, by the converge on 9
    assert not record.exists()
    # the host checks ran once 8's kernel was gone, and passed: the job's state says so (a cluster's
    # next node may start: plan.upgrade_perform.node_phase)
    assert f"host checks passed on kernel {new} after the 8 -> 9 upgrade" in rebooted.output, rebooted.output[-4000:]
    assert re.search(r"^checked=\d{4}-\d\d-\d\dT", status(), re.M), status()

    # a converge, the host checks, a run without changes
    with pc.Operator(PERFORM_NAME):
        converge = run_pyinfra(inv, "deploy.py", timeout=1200)
    assert converge.rc == 0, converge.output[-6000:]
    checks = pc.host_checks(inv, {}, "nvidia_driver")
    assert checks is None, checks
    again = run_pyinfra(inv, "deploy.py", timeout=1200)
    assert again.rc == 0 and again.changed == 0, again.output[-6000:]
    print(f"timings: prepare {p['t_8'] + p['t_fetch']:.0f} s, job {t_job:.0f} s, total {time.monotonic() - t0:.0f} s")


CLUSTER = "s22dist"
NODES = ("s22-cla", "s22-clb")  # the two nodes upgraded (both perform)
PLAIN = "s22-clc"  # the third node: in the run, not upgraded (quorum: 3 votes, 2 needed, one node may reboot)
# node B's GPU CT: guest ids are cluster-wide, A (started first) has the profile's CT 200 and VM 300
GUESTS_B = """guests:
  lxc:
    201: |
      arch: amd64
      cores: 8
      hostname: llm-b
      memory: 65536
      net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:5E:20:01,ip=dhcp,type=veth
      ostype: debian
      rootfs: local-zfs:subvol-201-disk-0,size=50G
      swap: 0
      unprivileged: 1
"""
CT = {NODES[0]: 200, NODES[1]: 201}
# the job's own log lines (templates/pve-upgrade.sh.j2 step): `pvegpu: <UTC time> <status>: <step>`
JOB_LINE = re.compile(r"^pvegpu: (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) (running|done|failed): ", re.M)


def cluster_inventory(tmp: Path, hosts: dict) -> str:
    """One pyinfra inventory of several twins ({twin: spec}), as spec_inventory writes one: each
    host named by its twin, which is its Proxmox node name in the cluster twin."""
    spec = {"hosts": {t.name: {"ssh": {"hostname": t.address, "port": t.port, "user": "root", "key": t.key},
                               **host} for t, host in hosts.items()}}
    (tmp / "cluster.yml").write_text(json.dumps(spec))
    overrides = {t.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"} for t in hosts}
    inv = tmp / "cluster_inventory.py"
    inv.write_text("from spec.load import inventory_hosts\n"
                   f"hosts = inventory_hosts({str(tmp / 'cluster.yml')!r}, overrides={overrides!r})\n")
    return str(inv)


def job_span(log: str) -> tuple[str, str]:
    """The first and last time the job's log names (its steps' lines): when it ran."""
    times = [m.group(1) for m in JOB_LINE.finditer(log)]
    assert times, log[-4000:]
    return times[0], times[-1]


def test_two_cluster_nodes_in_turn(twin_factory, tmp_path, monkeypatch):
    """Two nodes of a three-node cluster twin taken from 8 to 9 in turn by pvegpu (issue 40 items 2
    and 4): nodes A and B prepared as above (8 converged, a running GPU CT each, the local
    repository and apt cache ready, sources on bookworm) with `proxmox_ve: 9`, `proxmox_ve_upgrade:
    perform` and reboot.allowed; node C a plain member of the run that does not upgrade (a rolling
    reboot in a two-node cluster is refused by quorum). Every run is one full `pyinfra <inventory>
    deploy.py` over the three nodes. Run 1: exactly one of A and B starts its job, the other waits
    naming it; once the job is done, a run reboots that node into 9's kernel (the roll, its checks)
    and its confirm writes `checked=`; the other waits until then, and starts in a later run; the
    same for it. Asserted: both on trixie and pve-manager 9, both running 9's kernel with nvidia
    built by GCC 14 and their CT back, the two jobs never overlapped (their logs' first and last
    step times), the host checks, and a last run over the three nodes without changes."""
    t0 = time.monotonic()
    prepared = {}
    for name, profile in ((NODES[0], PROFILE_8), (NODES[1], PROFILE_8 + GUESTS_B)):
        sub = tmp_path / name
        sub.mkdir()
        p = prepare(twin_factory, sub, monkeypatch, name=name, cluster=CLUSTER, profile=profile)
        du.move_sources(p["twin"], "trixie", "bookworm")  # the host as it is before the upgrade: the job moves them
        du.sh(p["twin"], f"pct start {CT[name]}")
        prepared[name] = p
    plain = twin_factory("kpro6", name=PLAIN, cluster=CLUSTER)
    t_prepare = time.monotonic() - t0
    twins = {n: prepared[n]["twin"] for n in NODES}
    roots = {n: prepared[n]["root"] for n in NODES}
    new = prepared[NODES[0]]["new"]
    specs = {n: host_spec(prepared[n]["sha"], 9, n, proxmox_ve_upgrade="perform",
                          reboot={"allowed": True, "rejoin_timeout": 120},
                          gpus={"0000:01:00.0": "lxc"}, containers={CT[n]: {"gpus": ["0000:01:00.0"]}},
                          guests={"allow_stop": True}) for n in NODES}
    inv = cluster_inventory(tmp_path, {**{twins[n]: specs[n] for n in NODES}, plain: {"node": PLAIN}})
    members = json.loads(du.sh(plain, "cat /etc/pve/.members").stdout)
    assert sorted(members["nodelist"]) == sorted([*NODES, PLAIN]), members

    def status(n: str) -> str:
        state = roots[n] / STATE / "state"
        return state.read_text() if state.exists() else ""

    def run(label: str):
        start = time.monotonic()
        with pc.Operator(NODES[0]), pc.Operator(NODES[1]):
            done = run_pyinfra(inv, "deploy.py", timeout=1500)
        runs.append(f"{label}: rc {done.rc}, changed {done.changed}, {time.monotonic() - start:.0f} s")
        (tmp_path / f"run-{len(runs)}.log").write_text(done.output)  # for the reader of a failure
        print(runs[-1], tmp_path / f"run-{len(runs)}.log")
        return done

    def wait_line(waiting: str, cluster_reason: str) -> str:
        return (f"pvegpu: host {waiting}: the 8 -> 9 upgrade waits: the nodes of cluster {CLUSTER} are upgraded "
                f"one at a time, and {cluster_reason}")

    def job_done(n: str) -> float:
        start = time.monotonic()
        deadline = start + 2400
        while "status=running" in status(n) and time.monotonic() < deadline:
            time.sleep(2)
        log = (roots[n] / STATE / "upgrade.log").read_text()
        (REPO / ".cache" / "distup" / f"last-perform-{n}.log").write_text(log)
        assert "status=done" in status(n), status(n) + log[-8000:]
        assert (roots[n] / HOOK_DIR / f"{new}.ok").exists(), log[-8000:]  # the hook built for 9's kernel in the job
        runtime.kill_sshd(n)  # 8's sshd listener cannot serve 9's sshd-session (as in the tests above)
        du.sh(twins[n], "true")  # its sshd answers again (restarted by the supervisor, as systemd would)
        return time.monotonic() - start

    runs: list[str] = []
    t_jobs = {}
    with du.Network(twins[NODES[0]]), du.Network(twins[NODES[1]]):
        # run 1: one of A and B starts (the first to claim the run's turn), the other waits naming it
        one = run("run 1 (one node starts)")
        assert one.rc != 0, one.output[-6000:]  # the waiting node fails alone
        started = [n for n in NODES if f"{n}: the Proxmox VE 8 -> 9 upgrade starts detached on the host" in one.output]
        assert len(started) == 1, one.output[-6000:]
        first, second = started[0], next(n for n in NODES if n != started[0])
        assert wait_line(second, f"{first} starts its upgrade in this run") in one.output, one.output[-6000:]
        assert status(second) == "" and "status: running" in du.sh(twins[second], f"pct status {CT[second]}").stdout
        assert "status: stopped" in du.sh(twins[first], f"pct status {CT[first]}").stdout
        t_jobs[first] = job_done(first)

        # run 2: the first node converges on 9 and reboots into 9's kernel (the roll: back in its quorate
        # cluster, the reboot's checks), its CT starts again, its confirm writes checked=; the second
        # still waits, for the reason the first node's phase had when the run read it
        two = run(f"run 2 ({first} reboots into 9, {second} waits)")
        assert two.rc != 0 and f"{first}: back in cluster {CLUSTER} (quorate, 3 of 3 votes online)" in two.output, \
            two.output[-6000:]
        assert f"{first}: host checks passed on kernel {new} after the 8 -> 9 upgrade" in two.output, two.output[-6000:]
        assert "checked=" in status(first), status(first) + two.output[-6000:]
        assert du.sh(twins[first], "uname -r").stdout.strip() == new
        assert "status: running" in du.sh(twins[first], f"pct status {CT[first]}").stdout, two.output[-6000:]
        assert wait_line(second, f"{first}: its upgrade is done and it still runs 8's kernel {OLD_KERNEL}: its reboot "
                                 "into 9's kernel is due") in two.output, two.output[-6000:]
        assert status(second) == ""

        # run 3: the first is done: the second starts (the first converges what its reboot run left)
        three = run(f"run 3 ({second} starts)")
        assert three.rc == 0, three.output[-6000:]
        assert f"{second}: the Proxmox VE 8 -> 9 upgrade starts detached on the host" in three.output, \
            three.output[-6000:]
        assert "status: stopped" in du.sh(twins[second], f"pct status {CT[second]}").stdout
        t_jobs[second] = job_done(second)

        # run 4: the second reboots into 9's kernel and is checked
        four = run(f"run 4 ({second} reboots into 9)")
        assert four.rc == 0 and f"{second}: back in cluster {CLUSTER} (quorate, 3 of 3 votes online)" in four.output, \
            four.output[-6000:]
        assert "checked=" in status(second), status(second) + four.output[-6000:]
    # run 5: a converge (what the reboot run leaves: the depmod stamp of 9's kernel whose modules the
    # job's hook built, the NCCL file of the CT started after the NCCL stage ran)
    converge = run("run 5 (converge)")
    assert converge.rc == 0, converge.output[-6000:]

    for n in NODES:
        twin = twins[n]
        assert du.sh(twin, "dpkg --audit").stdout.strip() == ""
        assert du.sh(twin, ". /etc/os-release && echo $VERSION_CODENAME").stdout.strip() == "trixie"
        assert du.sh(twin, "dpkg-query -W -f '${Version}' pve-manager").stdout == du.PVE["trixie"]["pve-manager"]
        assert du.sh(twin, "uname -r").stdout.strip() == new
        comment = du.sh(twin, f"readelf -p .comment /lib/modules/{new}/updates/pvegpu-nvidia/nvidia.ko").stdout
        assert "14.2.0" in comment and "12.2.0" not in comment, comment
        assert pc.gpu_driver(n) == VERSION
        assert "status: running" in du.sh(twin, f"pct status {CT[n]}").stdout
        assert not (roots[n] / STATE / "guests-stopped").exists()
        checks = pc.host_checks(spec_inventory(tmp_path / n, twin, specs[n], "checks"), {}, "nvidia_driver")
        assert checks is None, checks
    # the two upgrade jobs never overlapped
    spans = {n: job_span((roots[n] / STATE / "upgrade.log").read_text()) for n in NODES}
    print("jobs:", spans)
    assert spans[first][1] <= spans[second][0], spans
    assert du.sh(plain, ". /etc/os-release && echo $VERSION_CODENAME").stdout.strip() == "bookworm"

    again = run("run 6 (no changes)")
    assert again.rc == 0 and again.changed == 0, again.output[-6000:]
    print(f"timings: prepare (two nodes, C started) {t_prepare:.0f} s, jobs {t_jobs[first]:.0f} s + "
          f"{t_jobs[second]:.0f} s (waited after their start), runs: {'; '.join(runs)}; "
          f"total {time.monotonic() - t0:.0f} s")
