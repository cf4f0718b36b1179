"""Power cuts on a twin (issue 38 §3): run an action once to record its steps, then run it again
and cut the twin's power when step i begins.

A step is a line that marks the start of one piece of work, from what the real programs write as
they go:

- `pyinfra --debug`: "Running command on <host>: ..." (one remote command of an operation begins;
  an operation's first command is its boundary);
- dpkg's own log, <root>/var/log/dpkg.log (dpkg src/main/... log_message: "startup", "install",
  "upgrade", "status <state> <pkg> <ver>", "configure", "trigproc"), one line per state change;
- the output of the command itself where it streams it (apt over SSH: "Unpacking ...",
  "Setting up ...", "Processing triggers for ...", run-parts' "executing /etc/kernel/postinst.d/X",
  proxmox-boot-tool's "Copying and configuring kernels on ...", the kernel hook's "pvegpu: ...").

A cut (`power_cut`) is what a reset does to a real host, with nothing of a shutdown: every process
of the twin (all but its supervisor, which stands for the machine) is stopped with SIGSTOP in the
same instant the step is seen (repeated until no new one appears), then the reset button is
pressed (tests/twin/runtime.py reset): the supervisor SIGKILLs them, unmounts its namespace's
mounts (no process is left to write), renders the next boot (tests/twin/hardware.py choose_boot:
the firmware's and loader's choice, one-shots consumed, a kernel on the no-boot list hangs or
panics as it says) and boots. No sync, no unmount by the twin's programs.

The twin's disk is an overlay whose upper dir is a plain directory of this machine: what a
process wrote before the cut is kept, fsync'd or not (the page cache survives a twin's reset).
A real disk can lose writes that were not fsync'd; that is out of scope here, so the cuts test
the order of the steps (what is on disk at each step boundary), not write durability.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.twin import runtime

DPKG_LOG = "var/log/dpkg.log"
# lines of a command's own output that begin a step (matched at the start of the line)
OUTPUT_STEPS = re.compile(
    r"^(--> Starting operation|Preparing to unpack |Unpacking |Setting up |"
    r"Processing triggers for |run-parts: executing |Copying and configuring kernels on |"
    r"Copying kernel and creating boot-entry for |Removing |pvegpu: [a-z]|Examining /etc/kernel/)"
    # pyinfra --debug (pyinfra/connectors/ssh.py run_shell_command): one remote command begins
    r"|^.{0,80}?(Running command on .*)")


def _key(line: str) -> str:
    """A step's identity across runs: digits, hex words and temp names collapsed."""
    line = re.sub(r"/tmp/[\w./-]+", "/tmp/_", line)
    line = re.sub(r"\b[0-9a-f]{8,}\b", "_", line)
    line = re.sub(r"\d+(\.\d+)*s\b", "_s", line)  # durations
    return line.strip()[:200]


@dataclass
class Run:
    steps: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each step began (s from the start)
    output: str = ""
    rc: int | None = None
    cut: str | None = None  # the step at which the power was cut (None: ran to its end)


def freeze(name: str) -> list[int]:
    """SIGSTOP every process of twin `name` but its supervisor, until no new one appears."""
    spec = runtime.spec_of(name)
    stopped: set[int] = set()
    for _ in range(50):
        # the supervisor stands for the machine; unshare (its parent, in the twin's mount namespace)
        # is this machine's
        new = [p for p in runtime.twin_processes(spec)
               if p not in (spec["pid"], spec.get("unshare_pid")) and p not in stopped]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            stopped.add(pid)
    return sorted(stopped)


def boots(name: str) -> list[str]:
    path = runtime.twin_dir(name) / "boots"
    return path.read_text().splitlines() if path.exists() else []


def power_cut(name: str, timeout: float = 90.0) -> str:
    """Cut the power of twin `name` and wait for the boot that follows; that boot's line of
    `boots` ("<time> <n>" or "<time> <n> hung")."""
    before = len(boots(name))
    freeze(name)
    runtime.reset(name)
    deadline = time.monotonic() + timeout
    while len(boots(name)) == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"twin {name} did not boot after the power cut")
        time.sleep(0.05)
    return boots(name)[-1]


class Operator:
    """The operator at the console while a sequence or a converge runs: a boot that hangs (no
    sshd: a kernel on the no-boot list, a hung trial) gets the reset button after `wait_s`, as the
    kernel stage's docs ask of an operator; each hung boot once. A context manager (a thread)."""

    def __init__(self, name: str, wait_s: float = 2.0):
        self.name, self.wait_s = name, wait_s
        self.resets = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Operator:
        self._handled = len(boots(self.name))
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            lines = boots(self.name)
            if len(lines) > self._handled and lines[-1].endswith(" hung"):
                self._handled = len(lines)
                if self._stop.wait(self.wait_s):
                    return
                if len(boots(self.name)) == self._handled:
                    runtime.reset(self.name)
                    self.resets += 1


def run_steps(name: str, command: list[str], env: dict | None = None,
              cut_at: tuple[str, int, float] | None = None, timeout: float = 900.0) -> Run:
    """Run `command` (here: pyinfra, or ssh into the twin) while watching its output and the twin's
    dpkg log for steps. cut_at=(key, n, delay): cut the twin's power `delay` seconds after the
    n-th step with that key began (the operator's side, `command`, is killed with it)."""
    root = Path(runtime.spec_of(name)["root"])
    log = root / DPKG_LOG
    offset = log.stat().st_size if log.exists() else 0
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, cwd=runtime.REPO, start_new_session=True)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    run, seen = Run(), Counter[str]()
    operator = Operator(name).__enter__()
    out: list[str] = []
    pending, dpkg_pending = b"", b""
    deadline = t0 + timeout
    cut_time: float | None = None

    def cut() -> Run:
        operator.__exit__()
        os.kill(proc.pid, signal.SIGSTOP)  # the operator's side stops with the host
        run.cut = f"{cut_at[0]} #{cut_at[1]} +{cut_at[2]} s" if cut_at else None
        power_cut(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        run.output = "\n".join(out)
        return run

    try:
        while True:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{command[:3]} ran past {timeout} s")
            if cut_time is not None and now >= cut_time:
                return cut()
            ready, _, _ = select.select([fd], [], [], 0.003)
            lines: list[str] = []
            eof = False
            if ready:
                chunk = os.read(fd, 65536)
                eof = not chunk
                pending += chunk
                *full, pending = pending.split(b"\n")
                for raw in full:
                    text = raw.decode(errors="replace").strip()
                    out.append(text)
                    m = OUTPUT_STEPS.match(text)
                    if m and not re.match(r"pvegpu: [a-z ]+ \| ", text):  # not pyinfra's results table
                        lines.append(m.group(2) or text)
            try:
                with open(log, "rb") as f:
                    f.seek(offset)
                    new = f.read()
                offset += len(new)
                dpkg_pending += new
                *full, dpkg_pending = dpkg_pending.split(b"\n")
                # "2026-12-05 23:10:00 status half-installed pkg:amd64 1": the date and time dropped
                lines += ["dpkg: " + raw.decode(errors="replace").split(" ", 2)[-1] for raw in full]
            except FileNotFoundError:
                pass
            for line in lines:
                key = _key(line)
                run.steps.append(key)
                run.times.append(time.monotonic() - t0)
                seen[key] += 1
                if cut_at is not None and cut_time is None and key == cut_at[0] and seen[key] == cut_at[1]:
                    cut_time = time.monotonic() + cut_at[2]
                    if cut_at[2] == 0:
                        return cut()
            if eof:
                break
        if cut_time is not None:  # the run ended before the delay was up: cut now
            return cut()
        run.rc = proc.wait()
    finally:
        operator.__exit__()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run.output = "\n".join(out + [pending.decode(errors="replace")])
    return run


def cut_points(steps: list[str]) -> list[tuple[str, int]]:
    """(key, n) of each step of a recorded run, in order."""
    seen: Counter = Counter()
    points = []
    for key in steps:
        seen[key] += 1
        points.append((key, seen[key]))
    return points


def timed_points(steps: list[str], times: list[float], min_s: float = 0.4,
                 min_gap: float = 0.0) -> list[tuple[str, int, float]]:
    """The cut points of a recorded run: each step's start (delay 0) and, where the step took
    at least `min_s` until the next one began, its middle too (a cut inside a long step: a
    maintainer script, a proxmox-boot-tool refresh, a module build). min_gap: a step that began
    less than this after the last cut point is not one of its own (dpkg writes several status
    lines of one package within milliseconds; the first of such a burst is cut)."""
    points: list[tuple[str, int, float]] = []
    last = float("-inf")
    for i, (key, n) in enumerate(cut_points(steps)):
        if times[i] - last >= min_gap:
            points.append((key, n, 0.0))
            last = times[i]
        if i + 1 < len(times) and times[i + 1] - times[i] >= min_s:
            points.append((key, n, round((times[i + 1] - times[i]) / 2, 2)))
            last = times[i] + (times[i + 1] - times[i]) / 2
    return points


# -- after a cut: what booted, the next converge, what the host is left with ------------------------

def attempts(root: Path) -> list[str]:
    path = root / "var/lib/twin/boot/attempts"
    return path.read_text().splitlines() if path.exists() else []


def press_reset(name: str) -> str:
    """The operator's reset button (a hung twin has no sshd); the next boot's line."""
    before = len(boots(name))
    runtime.reset(name)
    deadline = time.monotonic() + 60
    while len(boots(name)) == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"twin {name} did not boot after a reset")
        time.sleep(0.05)
    return boots(name)[-1]


def come_up(name: str, since: int, resets: int = 3) -> tuple[bool, list[str]]:
    """After a power-on: press reset while the twin hangs (an operator at the console does), at
    most `resets` times. (came up, the boot attempts logged after the first `since`)."""
    root = Path(runtime.spec_of(name)["root"])
    line = boots(name)[-1]
    for _ in range(resets):
        if not line.endswith(" hung"):
            break
        line = press_reset(name)
    return not line.endswith(" hung"), attempts(root)[since:]


def ssh(name: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return runtime.ssh_run(name, [command], timeout=timeout, pause_s=0.3)


def gpu_driver(name: str) -> str | None:
    """The NVIDIA driver version the running kernel loaded (None: no GPU driver: no GPUs)."""
    r = ssh(name, "cat /proc/driver/nvidia/version 2>/dev/null")
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", r.stdout)
    return m.group(1) if m else None


def reboot_plain(name: str) -> str:
    """`reboot` as an operator types it; the next boot's line."""
    before = len(boots(name))
    subprocess.run(runtime.ssh_command(name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while len(boots(name)) == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"twin {name} did not reboot")
        time.sleep(0.05)
    return boots(name)[-1]


@dataclass
class Outcome:
    point: str
    after_cut: list[str]  # the boot attempts right after the cut ("<release> <entry> <outcome>")
    final: str = ""  # the release running at the end
    unbootable: bool = False  # hung after the cut (3 resets) or at the final reboot
    no_gpus: bool = False  # came up without the NVIDIA driver after the converge
    problems: list[str] = field(default_factory=list)  # anything else: converge failed, checks red
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)  # the converges' output and the checks', for the record
    notes: list[str] = field(default_factory=list)  # what the operator had to do besides the converge

    @property
    def bad(self) -> bool:
        return self.unbootable or self.no_gpus

    def line(self) -> str:
        tag = "UNBOOTABLE" if self.unbootable else "NO GPUS" if self.no_gpus else "problem" if self.problems else "ok"
        return (f"{tag:10} {self.point[:110]} | after cut: {'; '.join(self.after_cut)[-160:]} | final {self.final}"
                + (f" | {' / '.join(self.problems)[:600]}" if self.problems else "")
                + (f" | note: {' / '.join(self.notes)[:300]}" if self.notes else ""))


def free_address() -> str:
    """A high 127.0.0.N no twin holds (its claim, runtime.ADDRESS_CLAIMS, held also while it
    reboots and its sshd does not answer) and nothing listens on: twins of other checkouts take
    the lowest free ones."""
    import socket
    taken = {t.get("address") for t in runtime.status()}
    for n in [200 + (os.getpid() + i) % 50 for i in range(50)]:
        address = f"127.0.0.{n}"
        if address in taken:
            continue
        claim = runtime._take_claim(address)  # a twin of any checkout holds its address's claim
        if claim is None:
            continue
        os.close(claim)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, runtime.SSH_PORT))
            except OSError:
                continue
        return address
    raise runtime.TwinError("no free 127.0.0.200-249 address")


def start_twin(name: str, profile: str, address: str | None = None, **kw) -> runtime.Twin:
    """runtime.start, tried again for a while when the address is taken meanwhile (a twin of
    another checkout rebooting: its sshd does not answer, its claim holds)."""
    for attempt in range(10):
        try:
            return runtime.start(name, profile, address=address or free_address(), owner=os.getpid(), **kw)
        except runtime.TwinError as e:
            if "in use" not in str(e) and "claimed" not in str(e) or attempt == 9:
                raise
            time.sleep(3)
    raise AssertionError("unreachable")


class Case:
    """One sequence to cut: a fresh twin in the state before it (`setup`), the command that runs
    it (`action`), and what the host must be left with after the next converge (`recover`)."""

    name = ""

    def setup(self, name: str, tmp: Path) -> runtime.Twin:
        raise NotImplementedError

    def action(self, twin: runtime.Twin, tmp: Path) -> tuple[list[str], dict]:
        raise NotImplementedError

    def recover(self, twin: runtime.Twin, tmp: Path, outcome: Outcome) -> None:
        raise NotImplementedError


def record(case: Case, name: str, tmp: Path, stop: bool = True) -> tuple[Run, Outcome]:
    """The sequence run once without a cut: its steps and times, then the same recovery and
    checks as after a cut (a sweep is only as good as its baseline: that must end green)."""
    try:
        twin = case.setup(name, tmp)
        command, env = case.action(twin, tmp)
        run = run_steps(name, command, env)
        outcome = Outcome(point="(no cut)", after_cut=[])
        case.recover(twin, tmp, outcome)
        return run, outcome
    finally:
        if stop:
            runtime.stop(name)


def cut_once(case: Case, name: str, tmp: Path, point: tuple[str, int, float]) -> Outcome:
    """A fresh twin, the sequence cut at `point`, what boots, the next converge, the checks."""
    t0 = time.monotonic()
    try:
        twin = case.setup(name, tmp)
        root = Path(twin.root)
        command, env = case.action(twin, tmp)
        since = len(attempts(root))
        run = run_steps(name, command, env, cut_at=point)
        outcome = Outcome(point=f"{point[0]} #{point[1]}" + (f" +{point[2]} s" if point[2] else ""), after_cut=[])
        if run.cut is None:
            outcome.problems.append("the step was not reached in this run (the sequence differs from the recording)")
        up, outcome.after_cut = come_up(name, since)
        if not up:
            outcome.unbootable = True
            outcome.problems.append("hung after the cut and 3 resets")
        else:
            case.recover(twin, tmp, outcome)
        outcome.seconds = round(time.monotonic() - t0, 1)
        return outcome
    finally:
        runtime.stop(name)


def finish(name: str, outcome: Outcome, want_driver: str, same_kernel: bool = True) -> None:
    """The end state every case asks for: a reboot as the operator types it comes up (no hang,
    3 resets allowed as after the cut) on a kernel that loads `want_driver`."""
    outcome.final = ssh(name, "uname -r").stdout.strip()
    # the running kernel has the driver's modules (the twin loads modules at boot only; a real
    # host's NVIDIA stage loads what it installed with modprobe, the reboot below checks loading)
    modules = ssh(name, f"modinfo -k {outcome.final} -F version nvidia 2>/dev/null").stdout.strip()
    if modules != want_driver:
        outcome.no_gpus = True
        outcome.problems.append(f"runs {outcome.final}, whose nvidia modules are {modules or 'missing'}, "
                                f"not {want_driver}")
    root = Path(runtime.spec_of(name)["root"])
    since = len(attempts(root))
    reboot_plain(name)
    up, tried = come_up(name, since)
    if not up:
        outcome.unbootable = True
        outcome.problems.append(f"the reboot after the converge hung: {'; '.join(tried)}")
        return
    after = ssh(name, "uname -r").stdout.strip()
    driver = gpu_driver(name)
    if driver != want_driver:
        outcome.no_gpus = True
        outcome.problems.append(f"the reboot after the converge came up on {after} with nvidia "
                                f"{driver or 'not loaded'}, not {want_driver}")
    if same_kernel and after != outcome.final:
        outcome.problems.append(f"the reboot after the converge came up on {after}, not {outcome.final}")
    if len(tried) > 1:
        outcome.problems.append(f"the reboot after the converge needed resets: {'; '.join(tried)}")


def host_checks(inventory: str, env: dict, select: str, log: list[str] | None = None,
                files: tuple[str, ...] = ("tests/host/test_boot.py",)) -> str | None:
    """The host checks `select` picks (pytest -k) against the inventory; None when green, else
    the failures."""
    from tests.e2e.harness import PYTEST
    done = subprocess.run([PYTEST, "-q", "-rf", "-p", "no:cacheprovider", *files, "-k", select,
                           "--inventory", inventory], cwd=runtime.REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    if done.returncode == 0:
        return None
    if log is not None:
        log.append(f"== host checks\n{done.stdout}")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    return "host checks: " + ("; ".join(failed) or done.stdout[-800:])


def converge_until_done(name: str, inventory: str, deploy: str, env: dict, outcome: Outcome, runs: int = 3) -> bool:
    """The next converge, as an operator runs it after a power cut: run it; a run with changes is
    run again (a kernel trial's reboot ends one run, the next finishes it), at most `runs` times.
    True when the last run changed nothing and succeeded."""
    from tests.e2e.harness import run_pyinfra
    for i in range(runs):
        with Operator(name):
            done = run_pyinfra(inventory, deploy, env=env, timeout=900)
        outcome.log.append(f"== converge {i + 1}: rc {done.rc}, changed {done.changed}\n{done.output}")
        if done.rc == 0 and done.changed == 0:
            return True
        if i == runs - 1:
            outcome.problems.append(f"converge {i + 1} after the cut: rc {done.rc}, changed {done.changed}: "
                                    + _errors(done.output))
    return False


def _errors(out: str) -> str:
    keep = [line.strip() for line in out.splitlines()
            if re.search(r"error|failed|refus|WARNING|Error", line) and "Running command" not in line]
    return " / ".join(keep[-6:])[-1200:]


class KernelTrial(Case):
    """(a) The kernel stage on the kpro6 twin (systemd-boot, ESP, the real proxmox-boot-tool):
    dpkg -i of a finished build (tests/e2e/test_kernel_trial_e2e.py seed_finished_build), the
    trial one-shot, the reboot, the pin after it came up: one converge with reboot.allowed.
    hangs: the new kernel hangs at boot (hardware.py no-boot): the host must end on the old one.
    profile kpro6-grubesp: GRUB from the ESP (proxmox-boot-tool's grub mode, UEFI): the trial is
    `next_entry` in the ESP's grubenv (tests/e2e/test_grub_esp_e2e.py), which GRUB clears as it
    boots it (the twin's firmware model: hardware.py grub_boot_entry)."""

    def __init__(self, hangs: bool = False, profile: str = "kpro6"):
        self.hangs, self.profile = hangs, profile
        self.name = "kernel-trial" + ("-grubesp" if profile == "kpro6-grubesp" else "") + ("-hangs" if hangs else "")

    def setup(self, name: str, tmp: Path) -> runtime.Twin:
        import shutil

        from tests.e2e import test_kernel_trial_e2e as kt
        twin = start_twin(name, self.profile)
        root = Path(twin.root)
        debs = tmp / "debs"
        shutil.rmtree(debs, ignore_errors=True)
        kt.seed_finished_build(root, debs)
        if self.hangs:
            (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
            (root / "var/lib/twin/boot/no-boot").write_text(f"{kt.RELEASE} hangs\n")
        return twin

    def env(self, twin: runtime.Twin) -> dict:
        from tests.e2e import test_kernel_trial_e2e as kt
        return {"PVEGPU_TWINS": twin.name, "PVEGPU_STAGES": kt.STAGES, "PVEGPU_E2E_KERNEL": json.dumps(kt.KERNEL),
                "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}

    def action(self, twin: runtime.Twin, tmp: Path) -> tuple[list[str], dict]:
        from tests.e2e.harness import PYINFRA
        return [PYINFRA, "-y", "--debug", "inventories/twin.py", "tests/e2e/stage_deploy.py"], self.env(twin)

    def recover(self, twin: runtime.Twin, tmp: Path, outcome: Outcome) -> None:
        from plan import kernel as plan
        from tests.e2e import test_kernel_trial_e2e as kt
        root = Path(twin.root)
        if not converge_until_done(twin.name, "inventories/twin.py", "tests/e2e/stage_deploy.py", self.env(twin), outcome):
            outcome.unbootable = outcome.unbootable or "hung" in boots(twin.name)[-1]
            if outcome.unbootable:
                return
        want = kt.OLD if self.hangs else kt.RELEASE
        running = ssh(twin.name, "uname -r").stdout.strip()
        pin = root / "etc/kernel/proxmox-boot-pin"
        if running != want:
            outcome.problems.append(f"runs {running}, not {want}")
        if (pin.read_text().strip() if pin.exists() else None) != want:
            outcome.problems.append(f"pinned: {pin.read_text().strip() if pin.exists() else 'nothing'}, not {want}")
        failed = root / plan.TRIAL_FAILED.lstrip("/")
        if failed.exists() and not self.hangs:
            outcome.problems.append(f"a trial failure is recorded for a kernel that boots: {failed.read_text()[:300]}")
        checks = host_checks("inventories/twin.py", {"PVEGPU_TWINS": twin.name},
                             "loader_boots_next or no_installed_kernel_was_left", outcome.log)
        if checks:
            outcome.problems.append(checks)
        driver = json.loads((root / "var/lib/twin/profile.json").read_text())["nvidia"]["version"]
        finish(twin.name, outcome, driver)


# systemd-boot-efi at a higher version, built from the installed package's files (as
# tests/twin/test_boot_programs.py BOOT_EFI_UPGRADE does), placed in the twin's local repository so
# that apt upgrades it in the same transaction as the kernel
BOOT_EFI_DEB = r"""set -e
v=$(dpkg-query -W -f '${Version}' systemd-boot-efi)
for p in systemd-boot-efi systemd-boot; do
  d=$(mktemp -d /root/efideb.XXXXXX)
  mkdir -p "$d/DEBIAN"
  dpkg-query -L "$p" | while read -r f; do
    if [ -L "$f" ] && [ ! -d "$f" ]; then mkdir -p "$d$(dirname "$f")"; cp -P "$f" "$d$f"
    elif [ -f "$f" ]; then install -D "$f" "$d$f"; fi
  done
  for s in preinst postinst prerm postrm triggers conffiles; do
    for f in "/var/lib/dpkg/info/$p:amd64.$s" "/var/lib/dpkg/info/$p.$s"; do
      if [ -f "$f" ]; then cp "$f" "$d/DEBIAN/$s"; fi
    done
  done
  dpkg-query -s "$p" | grep -v '^Status:' | sed "s/^Version: .*/Version: $v+twin1/; s/systemd-boot-efi (= $v)/systemd-boot-efi (= $v+twin1)/" > "$d/DEBIAN/control"
  dpkg-deb -Zgzip -b "$d" "/opt/repo/${p}_${v}+twin1_amd64.deb" >/dev/null
  rm -rf "$d"
done
cd /opt/repo && dpkg-scanpackages -m . > Packages 2>/dev/null && apt-get -q update >/dev/null
"""
# kpro6's profile kernels (6.14.8-2-pve, 6.8.12-11-pve: packages without files, files seeded by the
# profile, with nvidia 595.71.05, another driver than the spec's): gone, so that the host is one
# that runs 6.1 and gets 6.12 (the newest) from the upgrade, as on a host that ran only these
DROP_PROFILE_KERNELS = r"""set -e
for r in 6.14.8-2-pve 6.8.12-11-pve; do
  dpkg --purge "proxmox-kernel-$r-signed" >/dev/null 2>&1 || true
  rm -rf "/boot/vmlinuz-$r" "/boot/initrd.img-$r" "/boot/config-$r" "/boot/System.map-$r" "/lib/modules/$r"
done
proxmox-boot-tool refresh >/dev/null
"""


class FullUpgrade(Case):
    """(b) `apt-get full-upgrade` on the kpro6 twin (systemd-boot on an ESP, proxmox-kernel-helper's
    real proxmox-boot-tool, trigger and hooks) running 6.1 with nvidia from the NVIDIA stage and
    pvegpu's kernel hook installed (tests/e2e/test_kernel_upgrade_e2e.py host_on_6_1): one
    transaction brings proxmox-kernel-6.12.118+deb12-amd64-signed, proxmox-headers-<rel> (the
    metas proxmox-default-kernel/-headers 2 -> proxmox-kernel-6.12) and a systemd-boot-efi upgrade
    (its files under /usr/lib/systemd/boot fire proxmox-kernel-helper's trigger: `reinit`). The
    hook builds nvidia for 6.12 in the kernel's postinst. apt's own order, dpkg's own states.
    The next converge: the NVIDIA and kernel-hook stages and the reboot policy, reboot allowed."""

    name = "full-upgrade"
    STAGES = "operations.nvidia,operations.kernel_hook,operations.reboot"

    def __init__(self, fails: bool = False) -> None:
        # fails: the driver cannot be built for 6.12 (test_kernel_upgrade_e2e mini_tree
        # fail_from_6_12): the hook keeps 6.1 the default; the host must end there with its driver
        self.fails = fails
        self.name = "full-upgrade" + ("-fails" if fails else "")
        self.saved: Path | None = None  # the twin's upper dir in the state before the upgrade
        self.address: str | None = None
        self.inventory = ""

    def setup(self, name: str, tmp: Path) -> runtime.Twin:
        """The host before the upgrade, made once (~45 s: apt, a reboot, the NVIDIA stage's
        build) and saved (runtime.save_upper); each cut starts a copy of it."""
        if self.saved is None or not self.saved.exists():
            self._make(name, tmp)
        return start_twin(name, "kpro6", address=self.address, saved_upper=self.saved)

    def _make(self, name: str, tmp: Path) -> None:
        import hashlib
        import shutil

        from tests.e2e import test_kernel_upgrade_e2e as up
        from tests.e2e.harness import run_pyinfra, spec_inventory
        shutil.rmtree(tmp / "debs-1", ignore_errors=True)
        shutil.rmtree(tmp / "debs-2", ignore_errors=True)
        twin = start_twin(name, "kpro6")
        try:
            root = Path(twin.root)
            archive = up.mini_tree(tmp, self.fails)
            (root / "opt/src").mkdir(parents=True, exist_ok=True)
            (root / up.ARCHIVE.lstrip("/")).write_bytes(archive.read_bytes())
            up.twin_sh(twin, "rm -f /usr/lib/x86_64-linux-gnu/libnvidia-ml.so*")
            up.twin_sh(twin, f"rm -f /lib/modules/{up.NEW}/build")
            up.publish(twin, tmp, upgrade=False)
            up.twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q install -y proxmox-default-kernel")
            up.twin_sh(twin, f"proxmox-boot-tool kernel pin {up.OLD} --next-boot && proxmox-boot-tool refresh")
            up.reboot(twin)
            up.twin_sh(twin, DROP_PROFILE_KERNELS)
            nvidia = {"version": up.VERSION, "open": True, "firmware": False, "persistenced": False,
                      "modules_source": {"url": f"file://{up.ARCHIVE}",
                                         "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}}
            self.inventory = spec_inventory(tmp, twin, {"node": "kpro6", "kernel_updates": "follow", "nvidia": nvidia,
                                                        "reboot": {"allowed": True}}, "upgrade")
            with Operator(name):
                first = run_pyinfra(self.inventory, up.STAGE_DEPLOY, env={"PVEGPU_STAGES": self.STAGES})
            assert first.rc == 0, first.output[-3000:]
            reboot_plain(name)  # the stage loads the module it built with modprobe; the twin loads modules at boot
            assert up.nvidia_version(twin, up.OLD) == up.VERSION and gpu_driver(name) == up.VERSION, first.output[-3000:]
            shutil.rmtree(tmp / "debs-2", ignore_errors=True)
            up.publish(twin, tmp, upgrade=True)
            up.twin_sh(twin, BOOT_EFI_DEB)
            self.address = twin.address
        except BaseException:
            runtime.stop(name)
            raise
        self.saved = tmp / "saved-upper"
        runtime.save_upper(name, self.saved)

    def action(self, twin: runtime.Twin, tmp: Path) -> tuple[list[str], dict]:
        return runtime.ssh_command(twin.name, ["DEBIAN_FRONTEND=noninteractive apt-get -q full-upgrade -y 2>&1"]), {}

    def recover(self, twin: runtime.Twin, tmp: Path, outcome: Outcome) -> None:
        from tests.e2e import test_kernel_upgrade_e2e as up
        converge_until_done(twin.name, self.inventory, up.STAGE_DEPLOY, {"PVEGPU_STAGES": self.STAGES}, outcome)
        # a kernel package dpkg left midway never ran its hooks to the end (the NVIDIA build, the ESP
        # refresh): the converge finishes those (operations/kernel_hook.py finish_packages; its
        # patterns, facts/kernel_hook.py: proxmox-kernel-helper's pending trigger is apt's to run)
        midway = ssh(twin.name, "dpkg-query -W -f '${db:Status-Abbrev} ${Package}\\n' 'proxmox-kernel-[0-9]*' "
                                "'proxmox-headers-[0-9]*' 'proxmox-default-*' 2>/dev/null").stdout.split("\n")
        # (reinst-required, the third letter R: apt's to unpack again, as half-installed ones)
        midway = [line.split()[1] for line in midway if len(line.split()) == 2 and line[1:2] in "UFWt"
                  and line[2:3] != "R"]
        if midway:
            outcome.problems.append(f"kernel packages dpkg left midway after the converge: {', '.join(midway)}")
        # with fails, the hook's record of 6.12 stays (the check of it is red by design; -k matches
        # substrings: its name has nvidia_driver in it too)
        checks = host_checks(self.inventory, {}, "nvidia_driver and not no_installed_kernel_was_left" if self.fails
                             else "nvidia_driver", outcome.log)
        if checks:
            outcome.problems.append(checks)
        finish(twin.name, outcome, up.VERSION, same_kernel=False)
        if self.fails and outcome.final != up.OLD:
            outcome.problems.append(f"runs {outcome.final}, not {up.OLD} (the kernel nvidia builds for)")
        if outcome.bad:
            return
        # what dpkg still has midway is the interrupted apt run's (pvegpu finishes kernel packages
        # only): the operator mends it as apt asks ("dpkg was interrupted, you must manually run
        # 'dpkg --configure -a'", then "Try 'apt --fix-broken install'") and runs it again; the host must
        # still boot a kernel with its driver after that (a systemd-boot-efi trigger's reinit, a
        # kernel configured now: the loader's choice can move)
        audit = ssh(twin.name, "dpkg --audit").stdout.strip()
        if audit:
            outcome.notes.append("dpkg left midway after the converge: " + " ".join(audit.split())[-200:])
            again = ssh(twin.name, "export DEBIAN_FRONTEND=noninteractive; dpkg --configure -a 2>&1; "
                                   "apt-get -q -y --fix-broken install 2>&1; apt-get -q -y full-upgrade 2>&1", timeout=900)
            outcome.log.append(f"== the operator's apt run again: rc {again.returncode}\n{again.stdout}")
            if ssh(twin.name, "dpkg --audit").stdout.strip():
                outcome.problems.append("dpkg --audit still reports packages after the operator's apt run")
            converge_until_done(twin.name, self.inventory, up.STAGE_DEPLOY, {"PVEGPU_STAGES": self.STAGES}, outcome)
            finish(twin.name, outcome, up.VERSION, same_kernel=False)



class DriverUpgrade(Case):
    """(c) A driver upgrade on the kpro6 twin (tests/e2e/test_driver_upgrade_e2e.py): nvidia
    595.71.05 loaded, 595.82.01's module built and installed for the running kernel (as the
    stage's build leaves it), its .run given; the NVIDIA stage installs the new user space over
    the loaded module and the reboot policy reboots once (reboot.allowed). The next converge: the
    same stages; the host must end running 595.82.01."""

    name = "driver-upgrade"
    STAGES = "operations.nvidia,operations.reboot"

    def setup(self, name: str, tmp: Path) -> runtime.Twin:
        import hashlib

        from tests.e2e import test_driver_upgrade_e2e as du
        from tests.twin import installer
        twin = start_twin(name, "kpro6")
        root = Path(twin.root)
        release = du.twin_sh(twin, "uname -r").strip()
        (root / "root/new-nvidia.c").write_text(du.modinfo_c({
            "version": du.NEW, "license": "Dual MIT/GPL", "name": "nvidia",
            "vermagic": f"{release} SMP preempt mod_unload modversions "}))
        moddir = f"/lib/modules/{release}/updates/pvegpu-nvidia"
        du.twin_sh(twin, f"gcc -c /root/new-nvidia.c -o {moddir}/nvidia.ko && depmod {release}")
        run = installer.build(du.NEW, root / "opt/nvidia")
        spec = {"hosts": {twin.name: {
            "ssh": {"hostname": twin.address, "port": twin.port, "user": "root", "key": twin.key},
            "node": "kpro6", "reboot": {"allowed": True},
            "nvidia": {"version": du.NEW, "persistenced": False,
                       "installer": {"url": f"/opt/nvidia/{run.name}",
                                     "sha256": hashlib.sha256(run.read_bytes()).hexdigest()}}}}}
        (tmp / "upgrade.yml").write_text(json.dumps(spec))
        self.inventory = str(tmp / "inventory.py")
        overrides = {twin.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
        Path(self.inventory).write_text("from spec.load import inventory_hosts\n"
                                        f"hosts = inventory_hosts({str(tmp / 'upgrade.yml')!r}, overrides={overrides!r})\n")
        return twin

    def action(self, twin: runtime.Twin, tmp: Path) -> tuple[list[str], dict]:
        from tests.e2e.harness import PYINFRA
        return ([PYINFRA, "-y", "--debug", self.inventory, "tests/e2e/stage_deploy.py"],
                {"PVEGPU_STAGES": self.STAGES, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})

    def recover(self, twin: runtime.Twin, tmp: Path, outcome: Outcome) -> None:
        from tests.e2e import test_driver_upgrade_e2e as du
        converge_until_done(twin.name, self.inventory, "tests/e2e/stage_deploy.py", {"PVEGPU_STAGES": self.STAGES},
                            outcome)
        driver = gpu_driver(twin.name)
        if driver != du.NEW:
            outcome.no_gpus = True
            outcome.problems.append(f"after the converge nvidia {driver or 'not loaded'} runs, not {du.NEW}")
        checks = host_checks(self.inventory, {}, "versions_are_equal", outcome.log, ("tests/host/test_nvidia.py",))
        if checks:
            outcome.problems.append(checks)
        finish(twin.name, outcome, du.NEW)


CASES: dict[str, type[Case] | Callable[[], Case]] = {
    "kernel-trial": KernelTrial,
    "kernel-trial-hangs": lambda: KernelTrial(hangs=True),
    "kernel-trial-grubesp": lambda: KernelTrial(profile="kpro6-grubesp"),
    "kernel-trial-grubesp-hangs": lambda: KernelTrial(hangs=True, profile="kpro6-grubesp"),
    "full-upgrade": FullUpgrade,
    "full-upgrade-fails": lambda: FullUpgrade(fails=True),
    "driver-upgrade": DriverUpgrade,
}
