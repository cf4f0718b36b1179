"""facts.shared: a reading several facts take (`uname -r`, dpkg's package list) is taken once per
batched probe, and every fact still gets exactly what it got from its own program.

The oracle is the real dpkg-query (this machine's, on a status database written here with the
cases that differ between "every package" and "packages named": a held package that is not
installed, a removed one with its config files, an unpacked one, an unknown name), asked the
questions the facts asked it before they shared the reading."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import FactBase

from facts.guest_state import GuestState
from facts.hardware import PROBE_GROUPS, combined_probe
from facts.kernel import ProxmoxKernels
from facts.kernel_hook import KernelHookState
from facts.proxmox import PVE_PACKAGES, NodeName, PvePackages, PveVersion, parse_dpkg_versions, parse_pve_version
from facts.shared import _glob_regex, dpkg_show

DPKG_QUERY = shutil.which("dpkg-query")
pytestmark = pytest.mark.skipif(DPKG_QUERY is None, reason="needs dpkg-query (the oracle)")

STATUS = [
    ("foo-held", "hold ok not-installed", ""),  # selection hold, not installed: no plain -W line
    ("proxmox-default-kernel", "install ok installed", "1.1.0"),
    ("proxmox-headers-6.14.8-2-pve", "install ok unpacked", "6.14.8-2"),
    ("proxmox-kernel-6.14", "hold ok installed", "6.14.8-2"),
    ("proxmox-kernel-6.8.12-4-pve-signed", "deinstall ok config-files", "6.8.12-4"),
    ("proxmox-kernel-helper", "install ok installed", "9.0.3"),
    ("proxmox-kernelx", "install ok installed", "1"),  # not proxmox-kernel-[0-9]*
    ("pve-container", "install ok installed", "6.0.9"),
    ("pve-manager", "install ok installed", "9.0.6"),
    ("qemu-server", "install ok half-configured", "9.0.16"),
]
# Before facts/shared.py: each fact asked dpkg-query itself, these questions.
DPKG_VERSIONS = "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'"
OLD_HOLDS = "dpkg-query -W -f '${db:Status-Abbrev} ${Package}\\n' 2>/dev/null | awk '$1 ~ /^h/ {print $2}'"
OLD_PACKAGES = (f"{DPKG_VERSIONS} proxmox-default-kernel proxmox-default-headers 'proxmox-kernel-[0-9]*' "
                "'proxmox-headers-[0-9]*' 2>/dev/null")


@pytest.fixture
def host(tmp_path: Path):
    """PATH with a dpkg-query that reads the database above and a uname, both logging each call."""
    admin = tmp_path / "dpkg"
    (admin / "updates").mkdir(parents=True)
    (admin / "info").mkdir()
    (admin / "status").write_text("".join(
        f"Package: {name}\nStatus: {status}\nArchitecture: amd64\n"
        + (f"Version: {version}\n" if version else "") + "Maintainer: x\nDescription: x\n\n"
        for name, status, version in STATUS))
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "dpkg-query").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "dpkg-query $*" >> {log}\nexec {DPKG_QUERY} --admindir={admin} "$@"\n')
    (bin_dir / "uname").write_text(f'#!/bin/sh\necho "uname $*" >> {log}\nexec {shutil.which("uname")} "$@"\n')
    (bin_dir / "apt-cache").write_text(f'#!/bin/sh\necho "apt-cache $*" >> {log}\necho "  Candidate: 1.2.0"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(command: str) -> list[str]:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env,
                              timeout=60).stdout.splitlines()

    def calls() -> list[str]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return lines

    return run, calls


def _alone(run, fact_class, kwargs=None):
    fact = fact_class()
    command = fact.command(**(kwargs or {})) if callable(fact.command) else fact.command
    lines = run(str(command))
    return fact.process(lines) if lines else fact.default()


def test_each_dpkg_answer_is_what_dpkg_query_answers_the_question_itself(host):
    run, _ = host
    assert _alone(run, PvePackages) == parse_dpkg_versions(
        run(f"{DPKG_VERSIONS} {' '.join(PVE_PACKAGES)} 2>/dev/null"))
    assert _alone(run, PvePackages) == {"pve-container": "6.0.9", "pve-manager": "9.0.6",
                                         "proxmox-kernel-helper": "9.0.3"}  # qemu-server: half-configured
    assert _alone(run, PveVersion) == parse_pve_version(
        run(f"{DPKG_VERSIONS} pve-manager 2>/dev/null && echo \"kernel $(uname -r)\"; true"))
    state = _alone(run, KernelHookState)
    assert state["holds"] == sorted(run(OLD_HOLDS)) == ["proxmox-kernel-6.14"]  # not foo-held (not installed)
    packages = KernelHookState().process(["@@ packages", *run(OLD_PACKAGES)])["packages"]
    assert state["packages"] == packages and "proxmox-kernelx" not in str(packages)
    assert state["headers_candidate"] == "1.2.0"  # default-kernel installed, default-headers unknown
    # the lines and the exit status: a pattern dpkg finds nothing for fails the show, as dpkg-query fails
    for names in (["pve-manager"], ["pve-manager", "proxmox-default-headers"], ["proxmox-kernel-[0-9]*"],
                  ["nothing-[0-9]*"], list(PVE_PACKAGES)):
        quoted = " ".join(f"'{n}'" for n in names)
        assert run(f"{dpkg_show(names)}; echo $?") == run(f"{DPKG_VERSIONS} {quoted} 2>/dev/null; echo $?"), names


def test_a_probe_takes_each_shared_reading_once_and_every_value_equals_the_fact_alone(host):
    run, calls = host
    requests: list[tuple[type[FactBase], dict]] = [
        (PveVersion, {}), (PvePackages, {}), (KernelHookState, {}), (NodeName, {}), (ProxmoxKernels, {}), (GuestState, {})]
    alone = [_alone(run, fc, kw) for fc, kw in requests]
    alone_calls = calls()
    assert sum(c.startswith("dpkg-query") for c in alone_calls) >= 3  # each fact asks on its own
    probe = combined_probe(requests)
    values = probe().process(run(str(probe().command)))
    assert values == alone
    probe_calls = calls()
    # before: dpkg-query 6 times (pve-manager, the packages, all for the holds, the kernel packages,
    # the two headers checks) and uname 4 times; now one list and one uname (-n -r -m: every
    # field a fact asks for; it was one uname per flag); dpkg's other question, who owns each
    # /boot/vmlinuz-* (KernelHookState "owners", issue 38 item 7), is not a package list: asked once
    assert [c for c in probe_calls if c.startswith("dpkg-query") and not c.startswith("dpkg-query -S ")] == [
        "dpkg-query -W -f=${db:Status-Abbrev} ${Package} ${Version}\\n *"]
    assert len([c for c in probe_calls if c.startswith("dpkg-query -S ")]) <= 1
    assert sorted(c for c in probe_calls if c.startswith("uname")) == ["uname -n -r -m"]


def test_a_reading_one_section_takes_is_not_taken_up_front():
    command = str(combined_probe([(PvePackages, {}), (NodeName, {})])().command)
    assert "_pvegpu_dpkg=$(" in command and command.index("@@pvegpu-section") < command.index("_pvegpu_dpkg=$(")


@pytest.mark.parametrize(("pattern", "name", "matches"), [
    ("proxmox-kernel-[0-9]*", "proxmox-kernel-6.14", True),
    ("proxmox-kernel-[0-9]*", "proxmox-kernelx", False),
    ("proxmox-kernel-[0-9]*", "proxmox-kernel-", False),
    ("libstdc++6", "libstdc++6", True),
    ("a.b", "axb", False),
    ("a?c", "abc", True),
])
def test_package_patterns_match_as_fnmatch(pattern, name, matches):
    out = subprocess.run(["awk", f"$2 ~ /{_glob_regex(pattern)}/ {{ print \"yes\" }}"], input=f"ii {name} 1\n",
                         capture_output=True, text=True).stdout
    assert (out == "yes\n") is matches


def _fake_lxc_info(tmp_path):
    """A PATH with an lxc-info that logs its arguments: CT 200 runs with this test's process as its
    init (its root: /), CT 201 runs nothing. Returns the log file and a runner of shell commands
    on that PATH (their output lines)."""
    log, bin_dir = tmp_path / "lxc.log", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lxc-info").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n[ "$2" = 200 ] && echo {os.getpid()}\ntrue\n')
    (bin_dir / "lxc-info").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(command: str) -> list[str]:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env,
                              timeout=60).stdout.splitlines()

    return log, run


def test_facts_looking_into_the_same_cts_ask_lxc_info_once_per_probe(tmp_path):
    """ContainerUserspace and NcclState both look into CT 200 through its init's root: one
    lxc-info per CT for the probe (was one per fact), each value what the fact reads alone."""
    from facts.containers import ContainerUserspace
    from facts.nccl import NcclState

    log, run = _fake_lxc_info(tmp_path)

    requests: list[tuple[type[FactBase], dict]] = [
        (ContainerUserspace, {"ctids": [200, 201]}), (NcclState, {"paths": ["/etc/nccl.conf"], "ctids": [200, 201]})]
    alone = [_alone(run, fc, kw) for fc, kw in requests]
    assert log.read_text().count("-n 200") == 2
    log.unlink()
    probe = combined_probe(requests)
    assert probe().process(run(str(probe().command))) == alone
    assert log.read_text().splitlines() == ["-n 200 -p -H", "-n 201 -p -H"]  # was each twice
    assert alone[0]["containers"][200]["root"] == alone[0]["host_root"] and 201 not in alone[0]["containers"]


def test_ct_init_pids_is_pure():
    """The CTs' reading is one fixed name over the CT ids its shell names: asking for CT sets
    leaves no state behind (it used to register each set's reading in a module dict)."""
    import facts.shared as shared
    from facts.shared import CT_PIDS, ct_init_pids

    before = (dict(shared.READINGS), dict(shared.SET_READINGS))
    first = ct_init_pids([200, 201])
    assert ct_init_pids([7]) != first and ct_init_pids(["200", 201]) == first
    assert (shared.READINGS, shared.SET_READINGS) == before
    assert f"{CT_PIDS}=$(set -- 200 201;" in first


def test_a_set_reading_is_taken_once_over_the_union_of_the_sections_sets(tmp_path):
    """ContainerUserspace asks for CT 200, NcclState for CTs 200 and 201: one lxc-info per CT for
    the probe (the old per-set readings asked for CT 200 twice), each value what the fact reads
    alone."""
    from facts.containers import ContainerUserspace
    from facts.nccl import NcclState

    log, run = _fake_lxc_info(tmp_path)

    requests: list[tuple[type[FactBase], dict]] = [
        (ContainerUserspace, {"ctids": [200]}), (NcclState, {"paths": ["/etc/nccl.conf"], "ctids": [200, 201]})]
    alone = [_alone(run, fc, kw) for fc, kw in requests]
    log.unlink()
    probe = combined_probe(requests)
    assert probe().process(run(str(probe().command))) == alone
    assert sorted(log.read_text().splitlines()) == ["-n 200 -p -H", "-n 201 -p -H"]
    assert alone[0]["containers"][200]["root"] == alone[1]["containers"][200]["root"] == alone[0]["host_root"]
    assert alone[1]["containers"][201]["root"] is None  # it runs no init


def test_managed_files_of_every_section_are_read_by_one_stat_and_one_sha256sum(tmp_path):
    """Five ManagedFiles requests (other paths each, one path in two of them, a link, a missing
    file, a file with a space): one `stat` and one `sha256sum` for the probe (was one of each per
    request), each value what the fact reads alone."""
    from facts.files import ManagedFiles

    files = tmp_path / "files"
    files.mkdir()
    for name in ("a", "b", "c d", "e"):
        (files / name).write_text(name + "\n")
    (files / "e").chmod(0o600)
    (files / "link").symlink_to(files / "a")
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for program in ("stat", "sha256sum"):
        (bin_dir / program).write_text(f'#!/bin/sh\necho {program} >> {log}\nexec {shutil.which(program)} "$@"\n')
        (bin_dir / program).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(command: str) -> list[str]:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env,
                              timeout=60).stdout.splitlines()

    f = [str(files / n) for n in ("a", "b", "c d", "e", "link", "missing")]
    requests: list[tuple[type[FactBase], dict]] = [
        (ManagedFiles, {"paths": [f[0], f[1]]}), (ManagedFiles, {"paths": [f[2], f[5]]}),
        (ManagedFiles, {"paths": [f[1], f[4]]}), (ManagedFiles, {"paths": [f[5]]}), (ManagedFiles, {"paths": [f[3]]})]
    alone = [_alone(run, fc, kw) for fc, kw in requests]
    assert log.read_text().split().count("stat") == 4  # each fact alone: its own (none without a file)
    log.unlink()
    probe = combined_probe(requests)
    assert probe().process(run(str(probe().command))) == alone
    assert sorted(log.read_text().split()) == ["sha256sum", "stat"]
    assert alone[0][f[1]] == alone[2][f[1]] and alone[2][f[4]] == {"link": f[0]} and alone[1][f[5]] is None
    assert alone[4][f[3]]["mode"] == "600" and alone[1][f[2]]["mode"] in ("644", "664")


@pytest.mark.parametrize("text", [
    b"one line\n", b"", b"\n", b"no line break at the end", b"a\\b  c\t\n\n  leading\n\n\ntrailing empties\n\n",
    b"x" * 5000 + b"\nlong\n",
])
def test_read_file_prints_what_cat_prints_without_a_program(tmp_path, text):
    """facts.shared.read_file / first_line against cat / head -n 1 (as lines: a last line without
    a line break gets one), in the shell the facts run in (sh)."""
    from facts.shared import first_line, read_file

    path = tmp_path / "f"
    path.write_bytes(text)

    def out(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", command], capture_output=True, timeout=60)

    assert out(read_file(str(path))).stdout.splitlines() == out(f"cat {path}").stdout.splitlines()
    assert out(first_line(str(path))).stdout.splitlines() == out(f"head -n 1 {path}").stdout.splitlines()
    assert out(f"cat {path} | {first_line()}").stdout.splitlines() == out(f"head -n 1 {path}").stdout.splitlines()
    # a file that cannot be opened: nothing, and a failure as cat's
    assert out(read_file(str(tmp_path / "missing"))).stdout == b""
    assert out(read_file(str(tmp_path / "missing"))).returncode != 0
    assert out(first_line(str(tmp_path / "missing"))).stdout == b""


def test_read_file_of_proc_files_equals_cat():
    from facts.shared import read_file

    for path in ("/proc/devices", "/proc/cmdline", "/proc/version", "/proc/meminfo"):
        cat = subprocess.run(["sh", "-c", f"cat {path}"], capture_output=True, timeout=60).stdout
        mine = subprocess.run(["sh", "-c", read_file(path)], capture_output=True, timeout=60).stdout
        if path == "/proc/meminfo":  # its values move; the lines' keys stay
            cat, mine = (b"\n".join(line.split(b":")[0] for line in x.splitlines()) for x in (cat, mine))
        assert mine == cat, path


def _kpro6_first_round():
    """The no-change converge's one probe for the kpro6 twin's spec: every stage's prefetch, as
    deploy.py asks facts.once.prefetch for it."""
    from operations import load_stages, upgrade
    from spec.load import inventory_hosts

    spec = dict(inventory_hosts(Path(__file__).resolve().parents[2] / "inventories/twin.yml"))["kpro6"]["pvegpu_spec"]
    requests = [r for _, module in load_stages() if hasattr(module, "prefetch") for r in module.prefetch(spec)]
    requests += upgrade.prefetch(spec)
    unique = {(fc.__module__, fc.__name__, repr(sorted(kw.items()))): (fc, kw) for fc, kw in requests}
    return combined_probe(list(unique.values()))


# the programs a probe may start for a whole file's text: the cluster-wide files whose size grows
# with the cluster (VM configs, the PCI mappings, HA resources) stay with cat
_CAT_KEPT = ("/etc/pve/qemu-server/", "/etc/pve/mapping/pci.cfg", "/etc/pve/ha/resources.cfg")


def test_the_kpro6_probe_starts_no_program_twice_for_one_reading(tmp_path):
    """The kpro6 twin's no-change probe run here, every program it starts through PATH logged:
    no program starts twice with the same arguments (before: cat of /proc/devices, of the driver's
    version, stat of / ... twice), no cat/head/sed/cut/sort/uniq/tail for a small file (the shell's
    read), and one stat and one sha256sum for all managed files."""
    probe = _kpro6_first_round()
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    names = ("cat head tail sed cut tr sort uniq grep awk stat sha256sum od ls readlink nproc uname dpkg-query "
             "lxc-info lxc-ls modinfo mokutil flock apt-cache").split()
    for name in names:
        real = shutil.which(name)
        if real:
            (bin_dir / name).write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> {log}\nexec {real} "$@"\n')
            (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = subprocess.run(["sh", "-c", str(probe().command)], capture_output=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # the grouped sections' pipeline passes the earlier groups' output on with plain `cat`s (no file
    # read; facts.hardware._grouped): two per group after the first
    glue = [c for c in log.read_text().splitlines() if c == "cat "]
    assert len(glue) <= 2 * (PROBE_GROUPS - 1), glue
    calls = [c for c in log.read_text().splitlines() if c != "cat "]
    started = [c.split(" ", 1)[0] for c in calls]
    assert len(calls) == len(set(calls)), sorted(c for c in calls if calls.count(c) > 1)
    assert not {"head", "tail", "sed", "cut", "sort", "uniq"} & set(started), calls
    assert all(c.split(" ", 1)[1].startswith(_CAT_KEPT) for c in calls if c.startswith("cat ")), calls
    assert started.count("sha256sum") <= 1 and started.count("stat") <= 3  # managed files, /, the bridges' sizes
    assert [c for c in calls if c.startswith("uname")] == ["uname -n -r -m"]  # was uname -r, -n, -m


@pytest.mark.parametrize("fields", [("kpro6", "6.14.8-2-pve", "x86_64"), ("node.example.com", "6.8.0 my build", "aarch64"),
                                    ("", "", "")])
def test_each_uname_field_is_cut_from_one_uname(tmp_path, fields):
    """`uname -n -r -m` prints node name, release and machine in that order, one space apart
    (coreutils src/uname.c): each fact's field is cut from that one line, the release being
    all between the first and the last space; no uname at all gives empty fields, as before."""
    from facts.shared import uname

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    body = f"[ \"$*\" = '-n -r -m' ] && echo '{' '.join(fields)}'" if any(fields) else "exit 1"
    (bin_dir / "uname").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "uname").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    got = [subprocess.run(["sh", "-c", uname(flag)], capture_output=True, text=True, env=env, timeout=60).stdout
           for flag in "nrm"]
    assert got == [f + "\n" for f in fields]
