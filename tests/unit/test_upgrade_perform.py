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


# -- the preflight (plan/upgrade_perform.py) ------------------------------------------------------

from plan.render import render_template  # noqa: E402
from plan.upgrade_perform import (  # noqa: E402
    MIN_FREE_BYTES,
    PerformView,
    job_reading,
    job_refusal,
    job_running,
    parse_sources,
    perform_refusals,
    pve8to9_fails,
    stale_pins,
)

# pve8to9's output as pve-manager PVE/CLI/pve8to9.pm (stable-8) prints it: print_header "= NAME =",
# $log_line "LEVEL: text" (uc of the level), the SUMMARY's counters; Term::ANSIColor codes around
# coloured lines (printed without a terminal too)
PVE8TO9_OK = """= CHECKING VERSION INFORMATION FOR PVE PACKAGES =

Checking for package updates..
PASS: all packages up-to-date

Checking proxmox-ve package version..
PASS: already upgraded to Proxmox VE 8.4 (or newer)

= MISCELLANEOUS CHECKS =

INFO: Checking common daemon services..
PASS: systemd unit 'pveproxy.service' is in state 'active'
\x1b[33mWARN: 1 running guest(s) detected - consider migrating or stopping them.\x1b[0m
SKIP: No containers on node detected.

= SUMMARY =

TOTAL:    7
\x1b[32mPASSED:   4\x1b[0m
SKIPPED:  1
\x1b[33mWARNINGS: 1\x1b[0m
FAILURES: 0
""".splitlines()
PVE8TO9_FAIL = [line.replace("FAILURES: 0", "\x1b[1;31mFAILURES: 1\x1b[0m") for line in PVE8TO9_OK]
PVE8TO9_FAIL.insert(5, "\x1b[1;31mFAIL: proxmox-ve package is too old, please upgrade to >= 8.4-0!\x1b[0m")

DEBIAN_SOURCES = ["Types: deb", "URIs: http://deb.debian.org/debian/", "Suites: bookworm bookworm-updates",
                  "Components: main contrib non-free-firmware", "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg",
                  "", "Types: deb", "URIs: http://security.debian.org/debian-security/", "Suites: bookworm-security",
                  "Components: main"]
PVE_LIST = ["deb http://download.proxmox.com/debian/pve bookworm pve-no-subscription"]


def good(**changes) -> PerformView:
    view = PerformView(pve8to9=PVE8TO9_OK, proxmox_ve="8.4.0", free_bytes=50 * 10**9,
                       sources=parse_sources({"/etc/apt/sources.list.d/debian.sources": DEBIAN_SOURCES,
                                              "/etc/apt/sources.list.d/pve-install-repo.list": PVE_LIST}))
    for key, value in changes.items():
        setattr(view, key, value)
    return view


def test_pve8to9_output_is_the_verdict():
    assert pve8to9_fails(PVE8TO9_OK) == ([], 0)
    assert pve8to9_fails(PVE8TO9_FAIL) == (["proxmox-ve package is too old, please upgrade to >= 8.4-0!"], 1)
    assert pve8to9_fails(PVE8TO9_OK[:10]) == ([], None)  # cut short: no summary


def test_a_host_ready_for_9_passes():
    assert perform_refusals(good()) == []


@pytest.mark.parametrize("changes,words", [
    (dict(pve8to9=PVE8TO9_FAIL), "pve8to9 --full reports 1 FAILURE(S): proxmox-ve package is too old"),
    (dict(pve8to9=PVE8TO9_OK[:10]), "pve8to9 --full did not finish"),
    (dict(pve8to9=None), "pve8to9 is not installed"),
    (dict(proxmox_ve="8.3.0"), "proxmox-ve is 8.3.0: the upgrade to 9 starts from the latest 8.4"),
    (dict(proxmox_ve=None), "proxmox-ve is not installed"),
    (dict(free_bytes=MIN_FREE_BYTES - 1), "/ has 10.0 GB free, the upgrade wants 10 GB"),
    (dict(running_gpu_guests=["CT 200"], allow_stop=False), "GPU guests run (CT 200) and guests.allow_stop is false"),
    (dict(running_gpu_guests=["VM 300"], reboot_guests="migrate"), "GPU guests run (VM 300) and reboot.guests is migrate"),
    (dict(holds=["proxmox-default-kernel", "proxmox-default-headers", "htop"]),
     "proxmox-default-kernel, proxmox-default-headers on hold (apt-mark showhold)"),
    (dict(sources=parse_sources({"/etc/apt/sources.list": PVE_LIST,
                                 "/etc/apt/sources.list.d/ceph.list":
                                 ["deb http://download.proxmox.com/debian/ceph-reef bookworm no-subscription"]})),
     "a Ceph repository before Squid is configured: ceph-reef (/etc/apt/sources.list.d/ceph.list:1)"),
    (dict(sources=parse_sources({"/etc/apt/sources.list": ["deb http://deb.debian.org/debian trixie main"]})),
     "no apt source names bookworm"),
    (dict(job=job_reading(["status=failed", "step=full-upgrade"], "free", ["E: Sub-process /usr/bin/dpkg returned"])),
     "the 8 -> 9 upgrade pvegpu started failed at step full-upgrade"),
])
def test_each_refusal_names_its_reason(changes, words):
    found = perform_refusals(good(**changes))
    assert len(found) == 1 and words in found[0], found


def test_running_guests_are_stopped_when_allowed():
    assert perform_refusals(good(running_gpu_guests=["CT 200", "VM 300"])) == []


def test_squid_and_disabled_stanzas_pass():
    sources = parse_sources({
        "/etc/apt/sources.list.d/debian.sources": DEBIAN_SOURCES,
        "/etc/apt/sources.list.d/ceph.sources": ["Types: deb", "URIs: http://download.proxmox.com/debian/ceph-squid",
                                                 "Suites: bookworm", "Components: no-subscription"],
        "/etc/apt/sources.list.d/old.sources": ["Types: deb", "URIs: http://download.proxmox.com/debian/ceph-quincy",
                                                "Suites: bookworm", "Enabled: no"],
        "/etc/apt/sources.list": ["# deb http://download.proxmox.com/debian/ceph-reef bookworm no-subscription"]})
    assert [(e.file.rsplit("/", 1)[1], e.suites) for e in sources] == [
        ("debian.sources", ("bookworm", "bookworm-updates")), ("debian.sources", ("bookworm-security",)),
        ("ceph.sources", ("bookworm",))]
    assert perform_refusals(good(sources=sources)) == []


def test_one_line_sources_with_options():
    entries = parse_sources({"/etc/apt/sources.list": [
        "deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://download.proxmox.com/debian/pve bookworm "
        "pve-no-subscription", "deb-src http://deb.debian.org/debian bookworm main", "deb cdrom:[Debian]/ bookworm"]})
    assert [(e.uris, e.suites, e.line) for e in entries][:2] == [
        (("http://download.proxmox.com/debian/pve",), ("bookworm",), 1),
        (("http://deb.debian.org/debian",), ("bookworm",), 2)]


def test_the_job_as_its_files_say():
    assert job_reading([], None, [])["status"] is None
    assert job_reading(["status=running", "step=update"], "held", [])["status"] == "running"
    # the state says running and nothing holds the lock: killed, or a power cut
    interrupted = job_reading(["status=running", "step=full-upgrade", "since=2026-12-06T19:00:00Z"], "free", ["x"])
    assert interrupted["status"] == "interrupted"
    assert "was interrupted" in job_refusal(interrupted) and "step full-upgrade" in job_refusal(interrupted)
    assert job_reading(["status=done", "step=reboot-into-9"], "free", [])["status"] == "done"
    failed = job_reading(["status=failed", "step=configure-pending"], "free",
                         [f"line {i}" for i in range(30)] + ["\x1b[31mred\x1b[0m"])
    text = job_refusal(failed)
    assert "line 10" not in text and "line 29" in text and "\\x1b[31mred" in text  # the tail, escaped
    assert "rm /var/lib/pvegpu/upgrade/state and run again" in text
    assert "journalctl -u pvegpu-upgrade" in job_running(job_reading(["status=running"], "held", []))


def test_pins_of_8_are_undone_after_the_upgrade():
    assert stale_pins({"pin": "6.8.12-11-pve", "grub_saved": None}) == {"unpin": True, "unset_saved": False}
    assert stale_pins({"pin": "6.17.2-1-pve"}) == {"unpin": False, "unset_saved": False}


def test_the_job_script_follows_the_upgrade_guide():
    script = render_template("pve-upgrade.sh.j2", state_dir="/var/lib/pvegpu/upgrade",
                             unpin=True, efi_default=False, unset_saved=False)
    assert "export DEBIAN_FRONTEND=noninteractive" in script
    assert "-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold" in script
    order = ["step running sources", "dpkg --force-confdef --force-confold --configure -a", "update ||",
             "-f install", "full-upgrade ||", "remove systemd-boot", "proxmox-boot-tool kernel unpin",
             'step "done"']
    places = [script.index(s) for s in order]
    assert places == sorted(places), places
    assert "bootctl" not in script and "grub-editenv" not in script
    start = render_template("pve-upgrade-start.sh.j2", state_dir="/var/lib/pvegpu/upgrade",
                            lock="/var/lib/pvegpu/upgrade/lock", script="/var/lib/pvegpu/upgrade/upgrade.sh",
                            unit="pvegpu-upgrade")
    assert "systemd-run --unit pvegpu-upgrade" in start and "setsid nohup /bin/sh /var/lib/pvegpu/upgrade/upgrade.sh" in start
    assert "dir=/var/lib/pvegpu/upgrade" in start and 'pvegpu_dir "$dir" 700' in start and "etc-pve-$stamp.tar.gz" in start


def _recorded(fact: str, name: str) -> dict:
    return yaml.safe_load((REPO / f"tests/unit/facts/upgrade.{fact}/twin-kpro6-{name}.yaml").read_text())["fact"]


def test_recorded_twin_facts_drive_the_preflight():
    """The facts as recorded on the kpro6 twin (tests/fixtures/twin-kpro6/upgrade-*.txt)."""
    pre = _recorded("UpgradePreflight", "upgrade-preflight-fail-ceph-reef")
    found = perform_refusals(PerformView(pve8to9=pre["pve8to9"], proxmox_ve="8.4.0", free_bytes=pre["free_bytes"],
                                         sources=parse_sources(pre["sources"])))
    assert [r.split(":")[0] for r in found] == ["pve8to9 --full reports 1 FAILURE(S)",
                                                "a Ceph repository before Squid is configured"], found
    moved = _recorded("UpgradePreflight", "upgrade-preflight-trixie-sources")
    assert "no apt source names bookworm" in perform_refusals(PerformView(
        pve8to9=moved["pve8to9"], proxmox_ve="8.4.0", sources=parse_sources(moved["sources"])))[0]
    job = _recorded("UpgradeJob", "upgrade-job-failed-configure")
    reading = job_reading(job["state"], job["lock"], job["log"])
    assert reading["status"] == "failed" and reading["step"] == "configure-pending"
    assert "pvegpu-test-broken: postinst fails" in job_refusal(reading)


# -- what a run does with the job (operations/upgrade.py), the facts given ------------------------

def _readings(pve_major: int, state: list[str], lock: str | None, kernel: str = "6.8.12-11-pve") -> dict:
    from facts.proxmox import PvePackages, PveVersion
    from facts.upgrade import UpgradeJob, UpgradePreflight, UpgradeState

    return {PveVersion: {"version": f"{pve_major}.4.1", "major": pve_major, "minor": 4, "running_kernel": kernel},
            UpgradeJob: {"state": state, "lock": lock, "log": ["E: Sub-process /usr/bin/dpkg returned an error code (1)"]},
            PvePackages: {"proxmox-ve": "8.4.0"}, UpgradeState: {"holds": []},
            UpgradePreflight: {"pve8to9": PVE8TO9_OK, "free_bytes": 50 * 10**9,
                               "sources": {"/etc/apt/sources.list.d/pve-install-repo.list": PVE_LIST}}}


@pytest.fixture
def perform_spec(tmp_path):
    return load_spec_file(spec_file(tmp_path, proxmox_ve_upgrade="perform", kernel=None))["kpro6"]


def _with(monkeypatch, readings: dict, reasons: list | None = None):
    from operations import upgrade

    monkeypatch.setattr(upgrade, "fact_once", lambda cls, **kw: readings.get(cls))
    monkeypatch.setattr(upgrade, "guest_state", lambda: {"lxc": {200: "running"}, "qemu": {}})
    monkeypatch.setattr(upgrade, "_rebooted_for_upgrade", lambda: False)
    if reasons is not None:
        import facts.run_state

        monkeypatch.setattr(facts.run_state, "need_reboot", lambda kind, detail, host=None: reasons.append((kind, detail)))
    return upgrade


def test_a_host_on_8_without_a_job_starts_it(monkeypatch, perform_spec):
    upgrade = _with(monkeypatch, _readings(8, [], None))
    assert upgrade.starts(perform_spec) and upgrade.running(perform_spec) is None
    assert upgrade.perform_preflight(perform_spec) == []


def test_check_never_starts_it(monkeypatch, tmp_path):
    spec = load_spec_file(spec_file(tmp_path, kernel=None))["kpro6"]
    upgrade = _with(monkeypatch, _readings(8, ["status=failed"], "free"))
    assert not upgrade.starts(spec) and upgrade.perform_preflight(spec) == [] and upgrade.running(spec) is None


def test_a_running_job_is_reported_and_starts_nothing(monkeypatch, perform_spec):
    upgrade = _with(monkeypatch, _readings(8, ["status=running", "step=full-upgrade"], "held"))
    assert not upgrade.starts(perform_spec) and upgrade.perform_preflight(perform_spec) == []
    assert "step full-upgrade" in (upgrade.running(perform_spec) or "")


def test_a_failed_job_refuses_even_once_pve_manager_is_9(monkeypatch, perform_spec):
    upgrade = _with(monkeypatch, _readings(9, ["status=failed", "step=full-upgrade"], "free"))
    found = upgrade.perform_preflight(perform_spec)
    assert len(found) == 1 and "failed at step full-upgrade" in found[0] and "returned an error code" in found[0]


def test_a_done_job_asks_for_the_reboot_into_9s_kernel(monkeypatch, perform_spec):
    reasons: list = []
    upgrade = _with(monkeypatch, _readings(9, ["status=done", "step=reboot-into-9"], "free"), reasons)
    assert not upgrade.starts(perform_spec) and upgrade.perform_preflight(perform_spec) == []
    upgrade.after_upgrade(perform_spec)
    assert reasons == [("upgrade", "the 8 -> 9 upgrade is done and the host runs 8's kernel 6.8.12-11-pve: boot 9's")]
    reasons.clear()
    upgrade = _with(monkeypatch, _readings(9, ["status=done"], "free", kernel="6.17.2-1-pve"), reasons)
    upgrade.after_upgrade(perform_spec)
    assert reasons == []  # booted into 9's kernel: nothing due


# -- the guests the start stopped, started again on 9 (issue 40: "guests back") -------------------

def test_the_record_of_stopped_guests():
    from facts.upgrade import parse_upgrade_job
    from plan.upgrade_perform import parse_stopped_guests

    found = parse_upgrade_job(["@@ state", "status=done", "@@ lock", "free", "@@ guests", "lxc 200", "qemu 300",
                               "@@ log", "Setting up pve-manager (9.2.11) ..."])
    assert found["guests"] == ["lxc 200", "qemu 300"] and found["log"] == ["Setting up pve-manager (9.2.11) ..."]
    assert parse_stopped_guests(["lxc 200", "qemu 300", "lxc 200", "rm -rf /", "qemu x", ""]) == [
        ("lxc", 200), ("qemu", 300)]
    assert render_template("pve-upgrade-guests.j2", guests=[("lxc", 200), ("qemu", 300)]) == "lxc 200\nqemu 300\n"


@pytest.mark.parametrize("status, kernel, rebooted, expected", [
    ("done", "6.17.2-1-pve", False, [("lxc", 200)]),      # the run after the reboot into 9's kernel
    ("done", "6.8.12-11-pve", True, [("lxc", 200)]),      # this run rebooted into 9 for the upgrade
    ("done", "6.8.12-11-pve", False, []),                 # still 8's kernel (no reboot allowed): they wait
    ("done", "6.14.11-4-bpo12-pve", False, []),           # 8's 6.14 is no 9 kernel
    ("done", "6.12.57", False, [("lxc", 200)]),           # rebooted by hand into a tarball build's kernel
    ("running", "6.17.2-1-pve", False, []),
    ("failed", "6.17.2-1-pve", True, []),
])
def test_guests_start_again_only_on_9s_kernel_after_a_done_job(status, kernel, rebooted, expected):
    from plan.upgrade_perform import guests_to_start

    assert guests_to_start({"status": status}, kernel, rebooted, [("lxc", 200)]) == expected


def test_the_start_records_the_guests_before_stopping_them(monkeypatch, perform_spec):
    readings = _readings(8, [], None)
    readings[next(k for k in readings if k.__name__ == "UpgradeJob")]["guests"] = ["qemu 300"]  # an earlier start's
    upgrade = _with(monkeypatch, readings)
    calls: list = []
    monkeypatch.setattr(upgrade, "start_upgrade", lambda **kw: calls.append(kw))
    monkeypatch.setattr(upgrade, "start_commands", lambda spec: ("script", "start"))
    upgrade.start(perform_spec)
    assert calls[0]["stop"] == [("lxc", 200)]
    assert calls[0]["record"] == "qemu 300\nlxc 200\n"


def test_the_start_operation_writes_the_record_first(monkeypatch):
    import base64

    from operations import upgrade

    monkeypatch.setattr(upgrade, "guest_stop_commands", lambda api, kind, gid, timeout: [f"STOP {kind} {gid}"])
    text = [str(c) for c in upgrade.start_upgrade._inner(
        script="s", start="START", stop=[("lxc", 200)], configs=[], timeout=60, record="lxc 200\n")]
    record = next(i for i, c in enumerate(text) if "/var/lib/pvegpu/upgrade/guests-stopped" in c)
    assert base64.b64encode(b"lxc 200\n").decode() in text[record]
    assert "pvegpu_dir /var/lib/pvegpu/upgrade 700" in text[record]
    assert record < text.index("STOP lxc 200") < text.index("START")


def test_guests_started_again_once_then_forgotten(monkeypatch, perform_spec):
    readings = _readings(9, ["status=done", "step=reboot-into-9"], "free", kernel="6.17.2-1-pve")
    readings[next(k for k in readings if k.__name__ == "UpgradeJob")]["guests"] = ["lxc 200", "qemu 300"]
    upgrade = _with(monkeypatch, readings)
    operation = upgrade.start_stopped_guests
    calls: list = []
    monkeypatch.setattr(upgrade, "start_stopped_guests", lambda **kw: calls.append(kw))
    monkeypatch.setattr(upgrade, "guest_state_changes", lambda: None)
    upgrade.restart_guests(perform_spec)
    assert calls and calls[0]["guests"] == [("lxc", 200), ("qemu", 300)]
    assert "CT 200, VM 300" in calls[0]["name"]
    ops = list(operation._inner(guests=[("lxc", 200), ("qemu", 300)]))
    assert [getattr(op, "args", None) for op in ops[:2]] == [("lxc", 200), ("qemu", 300)]
    assert str(ops[-1]) == "rm -f -- /var/lib/pvegpu/upgrade/guests-stopped"
    # on 8's kernel still, or without a record: nothing
    calls.clear()
    readings[next(k for k in readings if k.__name__ == "PveVersion")]["running_kernel"] = "6.8.12-11-pve"
    upgrade.restart_guests(perform_spec)
    readings[next(k for k in readings if k.__name__ == "PveVersion")]["running_kernel"] = "6.17.2-1-pve"
    readings[next(k for k in readings if k.__name__ == "UpgradeJob")]["guests"] = []
    upgrade.restart_guests(perform_spec)
    assert calls == []


# -- the Proxmox repository as 9 expects it (pve8to9.pm check_apt_repos, pve-manager master configs/) --

def _run_job(tmp_path: Path, files: dict[str, str], keyring: bool, ships_enterprise: bool) -> dict[str, str]:
    """The job script as rendered, run with its apt/dpkg stubbed and /etc/apt, the keyring, its state dir
    under tmp_path: the files it leaves."""
    import subprocess

    apt = tmp_path / "etc/apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    ring = tmp_path / "proxmox-archive-keyring.gpg"
    if keyring:
        ring.write_bytes(b"key")
    state = tmp_path / "state"
    state.mkdir()
    script = render_template("pve-upgrade.sh.j2", state_dir=str(state), unpin=False, efi_default=False,
                             unset_saved=False)
    script = script.replace("/etc/apt/", f"{apt}/").replace("/usr/share/keyrings/proxmox-archive-keyring.gpg",
                                                             str(ring))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # apt-get full-upgrade installs 9's pve-manager: its enterprise .sources (configs/pve-sources.sources)
    shipped = ("Types: deb\nURIs: https://enterprise.proxmox.com/debian/pve\nSuites: trixie\n"
               "Components: pve-enterprise\nSigned-By: /usr/share/keyrings/proxmox-archive-keyring.gpg\n")
    (bin_dir / "apt-get").write_text("#!/bin/sh\n" + (
        f"case \"$*\" in *full-upgrade*) printf '%s' '{shipped}' > {apt}/sources.list.d/pve-enterprise.sources;; esac\n"
        if ships_enterprise else ""))
    (bin_dir / "dpkg").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "dpkg-query").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    import os

    done = subprocess.run(["sh", str(tmp_path / "job.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert "status=done" in (state / "state").read_text(), done.stdout + done.stderr
    return {str(p.relative_to(apt)): p.read_text() for p in apt.rglob("*") if p.is_file()}


def test_one_line_proxmox_repos_get_what_9_expects(tmp_path):
    out = _run_job(tmp_path, {
        "sources.list": "deb http://deb.debian.org/debian bookworm main contrib\n",
        "sources.list.d/pve-install-repo.list": "deb http://download.proxmox.com/debian/pve bookworm pvetest\n",
        "sources.list.d/pve-enterprise.list": "# deb https://enterprise.proxmox.com/debian/pve bookworm pve-enterprise\n",
        "sources.list.d/mine.list": "deb [signed-by=/etc/apt/k.gpg] http://download.proxmox.com/debian/pve bookworm "
                                    "pve-no-subscription\n",
    }, keyring=True, ships_enterprise=True)
    ring = tmp_path / "proxmox-archive-keyring.gpg"
    assert out["sources.list"] == "deb http://deb.debian.org/debian trixie main contrib\n"  # not Proxmox's: suite only
    assert out["sources.list.d/pve-install-repo.list"] == \
        f"deb [signed-by={ring}] http://download.proxmox.com/debian/pve trixie pve-test\n"
    # the admin's key is kept; a disabled line stays disabled
    assert out["sources.list.d/mine.list"] == ("deb [signed-by=/etc/apt/k.gpg] http://download.proxmox.com/debian/pve "
                                               "trixie pve-no-subscription\n")
    assert out["sources.list.d/pve-enterprise.list"].startswith("# deb")
    # the host had no enterprise .sources: the one 9's pve-manager ships is kept, disabled
    shipped = out["sources.list.d/pve-enterprise.sources"]
    assert shipped.splitlines()[:2] == ["Types: deb", "Enabled: no"], shipped
    from plan.upgrade_perform import parse_sources

    assert parse_sources({"x.sources": shipped.splitlines()}) == []


def test_deb822_proxmox_repos_get_what_9_expects(tmp_path):
    debian = ("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
              "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    pve = ("Types: deb\nURIs: http://download.proxmox.com/debian/pve\nSuites: bookworm\nComponents: pvetest\n\n"
           "Types: deb\nURIs: https://enterprise.proxmox.com/debian/pve\nSuites: bookworm\nComponents: pve-enterprise\n"
           "Signed-By: /etc/apt/mine.gpg\n")
    out = _run_job(tmp_path, {"sources.list.d/debian.sources": debian, "sources.list.d/pve-enterprise.sources": pve},
                   keyring=True, ships_enterprise=False)
    ring = tmp_path / "proxmox-archive-keyring.gpg"
    assert out["sources.list.d/debian.sources"] == debian.replace("bookworm", "trixie")
    assert out["sources.list.d/pve-enterprise.sources"] == (
        "Types: deb\nURIs: http://download.proxmox.com/debian/pve\nSuites: trixie\nComponents: pve-test\n"
        f"Signed-By: {ring}\n\n"
        "Types: deb\nURIs: https://enterprise.proxmox.com/debian/pve\nSuites: trixie\nComponents: pve-enterprise\n"
        "Signed-By: /etc/apt/mine.gpg\n")  # the host's own enterprise .sources: enabled as it was


def test_without_the_keyring_no_signed_by_is_invented(tmp_path):
    out = _run_job(tmp_path, {"sources.list.d/pve-install-repo.list":
                              "deb http://download.proxmox.com/debian/pve bookworm pve-no-subscription\n"},
                   keyring=False, ships_enterprise=False)
    assert out["sources.list.d/pve-install-repo.list"] == \
        "deb http://download.proxmox.com/debian/pve trixie pve-no-subscription\n"
