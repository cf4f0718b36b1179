"""Faults on a twin (issue 9, "Faults"): each proves that nothing was lost and that simply
running the deploy again converges (and a further run changes nothing).

1. sshd killed in the middle of a run (during update-initramfs, which the handlers step runs
   once for every stage: the re-run retries it from its stamp)
2. a driver source whose sha256 is not the spec's (local path: preflight refusal; loopback
   HTTP mirror serving a corrupted archive: the fetch stops) — nothing installed
3. a driver build that fails half-way (a tiny source tarball made here: one file compiles,
   the next does not) — nothing installed, the old modules intact
4. a config write interrupted (the rename onto /etc/kernel/cmdline fails) — the target is old
   or new, never half-written; the previous version is kept as <path>.pvegpu-prev
5. a spec turned invalid (a bad role, a service name that is a path, a kernel config line that is
   not one, aliases that multiply) — exit status 2, the message names file/host/field, no connection

The driver faults run the NVIDIA stage alone (tests/e2e/stage_deploy.py) against Debian's 6.1
headers in the twin, with tiny tarballs whose "build" takes well under a second.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import PYINFRA, REPO, PyinfraRun, manifest_diff, root_manifest, run_host_checks, run_pyinfra
from tests.twin import runtime
from tests.twin.fixtures import TwinFactory

pytestmark = [pytest.mark.twin]

INVENTORY = "inventories/twin.py"
STAGE_DEPLOY = "tests/e2e/stage_deploy.py"
DRIVER = "595.71.05"  # the kpro6 profile's user space version: the stage refuses any other without an installer
MODULE_DIR = "lib/modules/{release}/updates/pvegpu-nvidia"


# -- helpers ---------------------------------------------------------------------------------

def twin_sh(twin, command: str, check: bool = True, timeout: int = 300) -> str:
    done = subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"in twin {twin.name}: {command}\n{done.stdout}{done.stderr}")
    return done.stdout


def deploy(twin, *args: str, env: dict | None = None) -> PyinfraRun:
    return run_pyinfra(INVENTORY, "deploy.py", *args, env={"PVEGPU_TWINS": twin.name, **(env or {})})


def converges_then_quiet(run_again) -> tuple[PyinfraRun, PyinfraRun]:
    """`run_again()` converges (rc 0) and one more run reports 0 changes."""
    again = run_again()
    assert again.rc == 0, "the re-run after the fault did not converge:\n" + again.output[-5000:]
    quiet = run_again()
    assert quiet.rc == 0, quiet.output[-4000:]
    assert quiet.totals.get("error", 0) == 0 and quiet.changed == 0, \
        "the run after the re-run still changed something:\n" + quiet.output[-4000:]
    return again, quiet


def managed_view(root: str | Path) -> dict[str, tuple]:
    """Manifest of the trees pvegpu writes its files in (/etc, /var/lib/pvegpu), merged view."""
    root = Path(root)
    out = {}
    for sub in ("etc", "var/lib/pvegpu"):
        if (root / sub).is_dir():
            out.update({f"{sub}/{rel}": entry for rel, entry in root_manifest(root / sub, volatile=()).items()})
    return out


def upper_manifest(twin) -> dict[str, tuple]:
    return root_manifest(Path(twin.root).parent / "upper")


def sshd_log_lines(twin) -> list[str]:
    """What the twin's sshd logged (it runs with -e into supervisor.log): every client that
    reaches it leaves a line (Accepted…, Connection closed…, kex_exchange_identification…)."""
    log = Path(twin.root).parent / "supervisor.log"
    return [line for line in log.read_text(errors="replace").splitlines()
            if line.strip() and not line.startswith(("twin:", "Server listening"))]


def twin_pids(twin, *, comm: str | None = None, cmdline_has: str | None = None) -> list[int]:
    """Host pids of the twin's processes (its pid namespace) matching a name or a cmdline word."""
    found = []
    for pid in runtime.twin_processes(runtime.spec_of(twin.name)):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (comm and name == comm) or (cmdline_has and cmdline_has in args):
            found.append(pid)
    return found


def log_is_still(twin, quiet_s: float):
    """A predicate: true once the sshd log has not changed for `quiet_s` seconds."""
    seen: dict[str, Any] = {"lines": None, "since": time.monotonic()}

    def still() -> bool:
        lines = sshd_log_lines(twin)
        if lines != seen["lines"]:
            seen.update(lines=lines, since=time.monotonic())
        return time.monotonic() - seen["since"] >= quiet_s

    return still


def wait_for(predicate, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


# -- 1. sshd killed in the middle of a stage --------------------------------------------------

def test_sshd_killed_mid_stage_then_rerun_converges(twin_factory):
    twin = twin_factory("kpro6", name="flt-sshd")
    before = managed_view(twin.root)

    env = {**os.environ, "PVEGPU_TWINS": twin.name}
    proc = subprocess.Popen([PYINFRA, "-y", INVENTORY, "deploy.py"], cwd=REPO,
                            env={**env, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the handlers step's update-initramfs takes seconds; kill every sshd of the twin in it
        assert wait_for(lambda: twin_pids(twin, cmdline_has="update-initramfs"), timeout=240), \
            "update-initramfs never ran in the twin"
        sshd = twin_pids(twin, comm="sshd")
        assert sshd, "no sshd process found in the twin"
        for pid in sshd:
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, "the run went on although its SSH connection was killed:\n" + output[-3000:]

    # the orphaned initramfs tools finish or die; then the supervisor's fresh sshd answers
    assert wait_for(lambda: not twin_pids(twin, cmdline_has="initramfs"), timeout=120, step=0.2)
    assert wait_for(lambda: subprocess.run(runtime.ssh_command(twin.name, ["true"]), capture_output=True).returncode == 0,
                    timeout=30, step=0.5), "the twin's sshd did not come back"
    interrupted = managed_view(twin.root)

    converges_then_quiet(lambda: deploy(twin))
    after = managed_view(twin.root)

    changed = [p for p in set(before) | set(interrupted) | set(after)
               if interrupted.get(p) != before.get(p)]
    assert changed, "the interrupted run wrote nothing; the kill came too early to test anything"
    torn = [f"{p}: interrupted {interrupted.get(p)}, before {before.get(p)}, after {after.get(p)}"
            for p in changed if interrupted.get(p) not in (before.get(p), after.get(p))
            and not p.endswith(".pvegpu-prev")]
    assert not torn, "files neither old nor new after the kill:\n" + "\n".join(torn)
    print("after the kill, new:", sorted(p for p in changed if interrupted.get(p) == after.get(p)),
          "old:", sorted(p for p in changed if interrupted.get(p) == before.get(p)))
    leftovers = [p for p in after if p.endswith(".pvegpu-tmp")]
    assert not leftovers, f"temp files left after the re-run: {leftovers}"
    # nothing lost: the cmdline the host had before pvegpu is kept where the user finds it
    assert after["etc/kernel/cmdline.pvegpu-prev"][2] == before["etc/kernel/cmdline"][2]

    checks = run_host_checks(INVENTORY, env={"PVEGPU_TWINS": twin.name})
    assert checks.returncode == 0, checks.stdout[-5000:] + checks.stderr[-2000:]


# -- 4. a config write interrupted --------------------------------------------------------------

def test_interrupted_config_write_keeps_old_file_and_previous_version(twin_factory):
    twin = twin_factory("kpro6", name="flt-write")
    target = Path(twin.root) / "etc/kernel/cmdline"
    original = target.read_bytes()
    before = managed_view(twin.root)

    # a rename onto a mount point fails (EBUSY) after the temp file is complete: the write is
    # interrupted exactly between "new content ready" and "new content in place"
    twin_sh(twin, "mount --bind /etc/kernel/cmdline /etc/kernel/cmdline")
    try:
        failed = deploy(twin)
    finally:
        twin_sh(twin, "umount /etc/kernel/cmdline")
    assert failed.rc != 0 and "Device or resource busy" in failed.output, failed.output[-4000:]
    assert target.read_bytes() == original, "the target changed although its rename failed"
    assert (target.parent / "cmdline.pvegpu-prev").read_bytes() == original
    stray = sorted(set(manifest_diff(before, managed_view(twin.root))))
    assert all("etc/kernel/cmdline.pvegpu-" in line for line in stray), \
        "the failed write changed other files:\n" + "\n".join(stray)

    # the re-run writes the file; a reader polling it meanwhile sees old or new, never a mix
    seen: set[bytes] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                seen.add(target.read_bytes())
            except FileNotFoundError:
                seen.add(b"<missing>")
            # yield: once pyinfra is imported in this process gevent may have patched threading,
            # and a loop that never sleeps would starve the deploy (seen: a 13-minute hang in CI)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        again = deploy(twin)
    finally:
        stop.set()
        watcher.join()
    assert again.rc == 0, again.output[-5000:]
    new = target.read_bytes()
    assert new != original and b"amd_iommu=on" in new
    assert seen <= {original, new}, f"a reader saw a half-written cmdline: {seen - {original, new}}"
    assert (target.parent / "cmdline.pvegpu-prev").read_bytes() == original, "the previous cmdline was lost"
    assert not (target.parent / "cmdline.pvegpu-tmp").exists()
    quiet = deploy(twin)
    assert quiet.rc == 0 and quiet.changed == 0, "the run after the re-run changed something:\n" + quiet.output[-4000:]


# -- 5. a spec turned invalid ----------------------------------------------------------------

# each: the host's spec (with its connection), the words the message must hold
INVALID_SPECS = {
    "role": (lambda c: {**c, "gpus": {"0000:01:00.0": "gpu-passthrough"}},
             ['gpus["0000:01:00.0"]', "'gpu-passthrough' is not a role"]),
    # issue 19: values checked for what they become, before the connection (the NCCL stage's
    # preflight only saw these after connecting)
    "unit-name": (lambda c: {**c, "nccl": {"services": ["../../../etc/cron.d/x"]}},
                  ["nccl.services[0]", "is not a systemd unit name: it holds '/'"]),
    "kconfig": (lambda c: {**c, "kernel": {"version": "6.1.192-pvegpu", "config_fragments": ["CONFIG_X=y\\"],
                                           "source": {"kind": "tarball", "url": "/root/l.tar.xz", "sha256": "0" * 64}}},
                ["kernel.config_fragments[0]", "is not a kernel config line"]),
    "laughs": (None, ["expands to more than 100000 values"]),
    # issue 31: values a consumer would read differently, and YAML that raised a traceback
    "cmdline-word": (lambda c: {**c, "iommu": {"params": ["quiet;reboot"]}}, ["iommu.params", "not ';'"]),
    "ref-option": (lambda c: {**c, "kernel": {"version": "6.14.11-4-pve", "source": {
        "kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": "--"}}},
        ["kernel.source.ref", "is not a full commit id"]),  # issue 39 item 3: only a full commit id
    "api-host": (lambda c: {**c, "proxmox_api": {"host": "fe80::1%x]@evil.example:443#", "token_name": "pvegpu",
                                                 "token_env": "PVE_TOKEN"}},
                 ["proxmox_api.host", "is not a network interface name"]),
    "tag": (lambda c: "hosts:\n  HOST:\n    ssh: " + json.dumps(c["ssh"]) + "\n    guests: {shutdown_timeout: !!int abc}\n",
            ["'abc' is not a valid !!int", "line 4"]),
}


@pytest.fixture(scope="module")
def spec_twin(twin_root_cache):
    """One kpro6 twin for every invalid-spec case: no case may reach it or change it, and each
    checks that for its own run (the sshd log and the upper dir before and after it)."""
    factory = TwinFactory()
    try:
        yield factory("kpro6", name=f"flt-spec-{os.getpid()}")  # unique: other runs may use this test too
    finally:
        errors = factory.stop_all()
        if errors:
            pytest.fail("twin teardown left something behind:\n" + "\n".join(errors))


@pytest.mark.parametrize("case", sorted(INVALID_SPECS))
def test_invalid_spec_stops_before_any_connection(spec_twin, tmp_path, case):
    twin = spec_twin
    make, words = INVALID_SPECS[case]
    connection = {"ssh": {"hostname": twin.address, "port": twin.port, "user": "root", "key": twin.key},
                  "node": "kpro6"}
    yml = tmp_path / "broken.yml"
    if make is None:  # aliases that multiply ("billion laughs"), under the twin's host
        levels = ["a: &a [" + ",".join(['"lol"'] * 9) + "]"]
        levels += [f"{n}: &{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)]
        yml.write_text("\n".join(levels) + f"\nhosts:\n  {twin.name}:\n    ssh: {json.dumps(connection['ssh'])}\n"
                       "    iommu: {params: *i}\n")
    elif isinstance(made := make(connection), str):  # YAML text: HOST is the twin's name
        yml.write_text(made.replace("HOST", twin.name))
    else:
        yml.write_text(json.dumps({"hosts": {twin.name: made}}))  # JSON is YAML
    inventory = tmp_path / "broken_inventory.py"
    inventory.write_text("from spec.load import inventory_hosts\n"
                         f"hosts = inventory_hosts({str(yml)!r}, overrides={{{twin.name!r}: "
                         "{'ssh_known_hosts_file': '/dev/null', 'ssh_strict_host_key_checking': 'off'}})\n")

    # the sshd log does record a client: one real login adds lines (the check below can fail)
    lines_before = sshd_log_lines(twin)
    twin_sh(twin, "true")
    assert wait_for(lambda: len(sshd_log_lines(twin)) > len(lines_before), timeout=5)
    # that session logs several lines (Accepted, Received disconnect, Disconnected), the last
    # ones late on a loaded machine: wait until the log is still for a while
    assert wait_for(log_is_still(twin, quiet_s=1.5), timeout=30)

    lines_before = sshd_log_lines(twin)
    upper_before = upper_manifest(twin)
    run = run_pyinfra(str(inventory), "deploy.py")
    assert run.rc == 2, f"exit status {run.rc}, want 2:\n{run.output[-3000:]}"
    assert str(yml) in run.output, run.output[-3000:]
    assert case in ("laughs", "tag") or f"host {twin.name}" in run.output, run.output[-3000:]
    assert all(w in run.output for w in words) and "Traceback" not in run.output, run.output[-3000:]
    assert "Connected" not in run.output and "Running command" not in run.output
    time.sleep(1)  # sshd logs a connection as it happens; give a straggler time to show
    assert sshd_log_lines(twin) == lines_before, "the twin's sshd saw a client:\n" + \
        "\n".join(sshd_log_lines(twin)[len(lines_before):])
    diff = manifest_diff(upper_before, upper_manifest(twin))
    assert not diff, "the twin's root changed:\n" + "\n".join(diff[:20])


# -- 2 + 3. driver sources: bad checksum, a build that fails half-way ---------------------------

def modinfo_c(fields: dict[str, str]) -> str:
    """C source of an object whose .modinfo section modinfo/depmod read like a module's."""
    body = "".join(f"{k}={v}".replace('"', '\\"') + "\\0" for k, v in fields.items())
    return f'__attribute__((section(".modinfo"), used)) static const char modinfo[] = "{body}";\n'


def source_tarball(top: str, files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def working_source(release: str) -> bytes:
    """A module tree whose build makes nvidia.ko / nvidia-uvm.ko of DRIVER for `release`."""
    fields = lambda name: {"version": DRIVER, "license": "Dual MIT/GPL", "name": name,  # noqa: E731
                           "vermagic": f"{release} SMP preempt mod_unload modversions "}
    return source_tarball("tiny-nvidia", {
        "Kbuild": "# tiny stand-in for NVIDIA's Kbuild\n",
        "nvidia.c": modinfo_c(fields("nvidia")),
        "nvidia-uvm.c": modinfo_c(fields("nvidia_uvm")),
        "Makefile": "modules:\n\t$(CC) -c nvidia.c -o nvidia.ko\n\t$(CC) -c nvidia-uvm.c -o nvidia-uvm.ko\n",
    })


def broken_source() -> bytes:
    """A module tree whose build compiles one file, then fails on the next."""
    return source_tarball("tiny-nvidia-broken", {
        "Kbuild": "# tiny stand-in for NVIDIA's Kbuild\n",
        "first.c": "int first(void) { return 1; }\n",
        "second.c": "int second(void) { return }\n",
        "Makefile": "modules:\n\t$(CC) -c first.c -o first.o\n\t$(CC) -c second.c -o second.o\n"
                    "\t$(CC) -c first.c -o nvidia.ko\n",
    })


class DriverTwin:
    """A kpro6 twin whose Debian-headers release already has an older pvegpu nvidia module;
    `run(url, sha256)` runs the NVIDIA stage alone with that modules source."""

    def __init__(self, twin, tmp: Path):
        self.twin, self.tmp = twin, tmp
        root = Path(twin.root)
        # Debian's headers (`build` is an absolute link, dangling seen from outside the twin)
        self.release = sorted(p.name for p in (root / "lib/modules").iterdir() if os.path.lexists(p / "build"))[-1]
        self.module_dir = MODULE_DIR.format(release=self.release)
        old = root / "root/old-nvidia.c"
        old.write_text(modinfo_c({"version": "535.216.01", "license": "Dual MIT/GPL", "name": "nvidia",
                                  "vermagic": f"{self.release} SMP preempt mod_unload modversions "}))
        twin_sh(twin, f"mkdir -p /{self.module_dir} && gcc -c /root/old-nvidia.c -o /{self.module_dir}/nvidia.ko "
                      f"&& depmod {self.release} && modinfo -k {self.release} -F version nvidia")

    def put(self, name: str, data: bytes) -> tuple[str, str]:
        """Place a source archive in the twin; (its path there, its sha256)."""
        (Path(self.twin.root) / "root" / name).write_bytes(data)
        return f"/root/{name}", hashlib.sha256(data).hexdigest()

    def installed(self) -> str:
        return twin_sh(self.twin, f"cd /lib/modules/{self.release} && sha256sum updates/pvegpu-nvidia/* "
                                  "modules.dep modules.dep.bin; modinfo -k $(basename $PWD) -F version nvidia")

    def run(self, url: str, sha256: str) -> PyinfraRun:
        spec = {"hosts": {self.twin.name: {
            "ssh": {"hostname": self.twin.address, "port": self.twin.port, "user": "root", "key": self.twin.key},
            "node": "kpro6",
            "nvidia": {"version": DRIVER, "modules_source": {"url": url, "sha256": sha256},
                       "firmware": False, "persistenced": False, "releases": [self.release]}}}}
        yml = self.tmp / "driver.yml"
        yml.write_text(json.dumps(spec))
        inventory = self.tmp / "driver_inventory.py"
        overrides = {self.twin.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
        inventory.write_text("from spec.load import inventory_hosts\n"
                             f"hosts = inventory_hosts({str(yml)!r}, overrides={overrides!r})\n")
        return run_pyinfra(str(inventory), STAGE_DEPLOY, env={"PVEGPU_STAGES": "operations.nvidia"})


@pytest.fixture
def driver_twin(twin_factory, tmp_path) -> DriverTwin:
    return DriverTwin(twin_factory("kpro6", name=f"flt-drv-{os.getpid() % 10000}"), tmp_path)


class _Mirror(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def loopback_mirror(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/mirror: yields (dir, base URL)."""
    directory = tmp_path / "mirror"
    directory.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: _Mirror(*a, directory=str(directory), **k))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield directory, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# The twin root has neither curl nor wget; this stand-in does what the fetch command asks of
# curl (-fsSL --retry N -o FILE URL) with Python's urllib, over the real loopback network.
CURL_STANDIN = """#!/usr/bin/python3
import sys, urllib.request
args = sys.argv[1:]
out = args[args.index("-o") + 1]
url = [a for a in args if a.startswith(("http://", "https://"))][-1]
try:
    with urllib.request.urlopen(url, timeout=30) as r, open(out, "wb") as f:
        f.write(r.read())
except Exception as e:
    print(f"curl: {e}", file=sys.stderr)
    sys.exit(22)
"""


def test_bad_checksum_installs_nothing(driver_twin, loopback_mirror):
    d = driver_twin
    good = working_source(d.release)
    path, sha = d.put("tiny-nvidia.tar.gz", good)
    installed = d.installed()
    assert "535.216.01" in installed

    # a local archive that is not the spec's: refused in preflight, before any change at all
    upper_before = upper_manifest(d.twin)
    wrong = hashlib.sha256(b"another archive").hexdigest()
    run = d.run(path, wrong)
    assert run.rc != 0
    assert f"modules source {path} has sha256 {sha} but the spec says {wrong}" in run.output, run.output[-3000:]
    # (the twin's Python stand-ins, run by the fact probe, leave their bytecode cache)
    diff = [line for line in manifest_diff(upper_before, upper_manifest(d.twin))
            if not line.startswith("usr/local/lib/twin/__pycache__")]
    assert not diff, "a refused run changed the twin:\n" + "\n".join(diff[:20])

    # a mirror serving a corrupted archive: the download is checked before anything uses it
    mirror_dir, base = loopback_mirror
    (mirror_dir / "tiny-nvidia.tar.gz").write_bytes(good[:-64] + b"\0" * 64)
    (Path(d.twin.root) / "usr/local/bin/curl").write_text(CURL_STANDIN)
    (Path(d.twin.root) / "usr/local/bin/curl").chmod(0o755)
    url = f"{base}/tiny-nvidia.tar.gz"
    run = d.run(url, sha)
    assert run.rc != 0
    assert f"checksum mismatch for {url}: the spec says {sha}" in run.output, run.output[-3000:]
    assert "nothing was built or installed" in run.output
    assert d.installed() == installed, "the old modules changed"
    cache = twin_sh(d.twin, "ls -A /var/cache/pvegpu/sources/ 2>/dev/null; ls -A /var/cache/pvegpu/nvidia-build/*/ 2>/dev/null; true")
    assert cache.strip() == "", f"a corrupted download was kept or built: {cache}"

    # the mirror fixed: the same spec converges, and a further run changes nothing
    (mirror_dir / "tiny-nvidia.tar.gz").write_bytes(good)
    converges_then_quiet(lambda: d.run(url, sha))
    assert twin_sh(d.twin, f"modinfo -k {d.release} -F version nvidia").strip() == DRIVER


def test_build_failing_half_way_keeps_old_modules(driver_twin):
    d = driver_twin
    installed = d.installed()
    path, sha = d.put("tiny-nvidia-broken.tar.gz", broken_source())
    run = d.run(path, sha)
    assert run.rc != 0
    assert f"building nvidia {DRIVER} for {d.release} failed; installed modules are untouched" in run.output, \
        run.output[-3000:]
    assert "second.c" in run.output, "the compiler's error is not shown:\n" + run.output[-3000:]
    # it did fail half-way: the first object was built, the second was not
    objects = twin_sh(d.twin, f"cd /var/cache/pvegpu/nvidia-build/{DRIVER}/{d.release}/src/tiny-nvidia-broken "
                              "&& ls *.o *.ko 2>/dev/null; true").split()
    assert objects == ["first.o"], objects
    assert d.installed() == installed, "a failed build changed the installed modules"

    # a fixed source: the re-run builds and installs it; a further run changes nothing
    path, sha = d.put("tiny-nvidia.tar.gz", working_source(d.release))
    converges_then_quiet(lambda: d.run(path, sha))
    assert twin_sh(d.twin, f"modinfo -k {d.release} -F version nvidia").strip() == DRIVER
    assert twin_sh(d.twin, "ls -A /var/cache/pvegpu/nvidia-build/*/ 2>/dev/null; true").strip() == "", \
        "the scratch build dir was left behind"
