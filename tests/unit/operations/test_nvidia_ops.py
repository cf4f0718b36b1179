"""NVIDIA driver stage: its fact parsed from real output, and its shell commands run for real
(checksum gate, version check); the build itself runs in tests/e2e/test_driver_build.py."""

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.nvidia import NvidiaHostState, parse_host_state
from operations import nvidia as ops
from plan import nvidia as nvplan
from spec.models import SourceSpec
from tests.unit.operations.oprun import run_op
from tests.unit.test_shell_templates import nvidia_kernel_archive

ROOT = Path(__file__).resolve().parents[3]

# `NvidiaHostState(releases=["6.1.0-57-amd64"], sources={"modules": ("/usr/src/nvidia-kernel.tar.xz", …)})`
# run in a Debian bookworm root (the twin's root: linux-headers-amd64 + nvidia-kernel-source),
# before the first build and after it.
RECORDED_BEFORE = """\
@@ cores
2
@@ meminfo
MemTotal:       24683568 kB
@@ running
6.18.44-fc-v1098
@@ ccache
/usr/bin/ccache
@@ compilers
gcc: gcc (Debian 12.2.0-14+deb12u1) 12.2.0
gcc-12: gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0
@@ release 6.18.44-fc-v1098
headers: no
module version: 
module vermagic: 
module filename: 
@@ release 6.1.0-57-amd64
headers: yes
CONFIG_CC_VERSION_TEXT=gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0
module version: 
module vermagic: 
module filename: 
@@ firmware
@@ userspace
@@ persistenced
@@ source modules
sha256 04906a73457a207f25dc3dbbb7f8fdc1dc088cc334e6fb2eb9b1419b823bfaaa
"""
SHA = "04906a73457a207f25dc3dbbb7f8fdc1dc088cc334e6fb2eb9b1419b823bfaaa"


def sh(command, env=None):
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def test_parse_recorded_state_before_first_build():
    state = parse_host_state(RECORDED_BEFORE.splitlines())
    assert state["cores"] == 2 and state["mem_total_kib"] == 24683568 and state["ccache"] is True
    assert state["running"] == "6.18.44-fc-v1098"
    assert state["compilers"]["gcc-12"] == "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
    assert state["releases"]["6.1.0-57-amd64"] == {
        "headers": True, "cc_version_text": "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "module": None,
        "config": {}, "sign_file": False}
    assert state["releases"]["6.18.44-fc-v1098"]["headers"] is False
    assert state["sources"] == {"modules": {"cached": False, "sha256": SHA}}
    assert state["firmware"] == {} and state["userspace"] == []
    steps = nvplan.driver_steps("535.309.01", ["6.1.0-57-amd64"], state, want_firmware=False,
                                modules_source=SourceSpec(url="/usr/src/nvidia-kernel.tar.xz", sha256=SHA))
    assert steps["refusals"] == [] and steps["releases"]["6.1.0-57-amd64"]["cc"] == "gcc-12"


def test_fact_command_runs_on_this_machine_and_parses():
    fact = NvidiaHostState()
    out = sh(fact.command(["6.1.0-57-amd64"], {"modules": ("/nonexistent/x.tar.xz", SHA)})).stdout.splitlines()
    state = fact.process(out)
    assert state["cores"] == os.cpu_count()
    assert state["running"] == os.uname().release
    assert state["sources"]["modules"] == {"cached": False, "sha256": None}
    assert "6.1.0-57-amd64" in state["releases"]


def test_source_names_and_local_paths():
    url = "https://github.com/NVIDIA/open-gpu-kernel-modules/archive/refs/tags/595.71.05.tar.gz"
    assert ops.source_name(url) == "595.71.05.tar.gz"
    assert ops.source_name("file:///srv/mirror/NVIDIA-Linux-x86_64-595.71.05.run") == "NVIDIA-Linux-x86_64-595.71.05.run"
    assert ops.source_name("/x/a b;$(rm).tgz") == "a_b___rm_.tgz"
    assert ops.local_path("file:///srv/a.run") == "/srv/a.run"
    assert ops.local_path("/srv/a.run") == "/srv/a.run"
    assert ops.local_path(url) is None
    src = SourceSpec(url=url, sha256=SHA)
    assert ops.cached_source(src) == f"{ops.SOURCE_CACHE}/{SHA}-595.71.05.tar.gz"


def test_fetch_checks_sha256_before_the_file_is_usable(tmp_path):
    archive = tmp_path / "nvidia kernel.tar.xz"
    archive.write_bytes(b"not really a tarball\n")
    good = hashlib.sha256(archive.read_bytes()).hexdigest()
    dest = tmp_path / "cache" / f"{good}-nvidia_kernel.tar.xz"

    bad = sh(ops.fetch_source_command(f"file://{archive}", "0" * 64, str(dest)))
    assert bad.returncode == 1
    assert f"the spec says {'0' * 64}, the file has {good}; nothing was built or installed" in bad.stderr
    assert not dest.exists() and not Path(str(dest) + ".part").exists()

    ok = sh(ops.fetch_source_command(str(archive), good, str(dest)))
    assert ok.returncode == 0, ok.stderr
    assert dest.read_bytes() == archive.read_bytes()
    archive.write_bytes(b"changed after verification\n")  # the verified copy is kept, not re-fetched
    assert sh(ops.fetch_source_command(str(archive), good, str(dest))).returncode == 0
    assert dest.read_bytes() == b"not really a tarball\n"


def test_fetch_op_always_fetches():
    """One operation contract (issue 18 part 7): an operation does its step; whether it runs is
    the plan's call (apply below)."""
    commands, _ = run_op(ops.fetch_source, url="/a", sha256="b" * 64, dest="/c")
    assert commands == [ops.fetch_source_command("/a", "b" * 64, "/c")]


def _apply_with_steps(monkeypatch, steps: dict, state: dict | None = None, stamps: dict | None = None,
                      releases: list[str] | None = None, loaded: str | None = None,
                      reboots: list | None = None) -> tuple[list[str], list[str]]:
    """ops.apply with the plan's steps given: (operations it called, lines it logged). `loaded`:
    the version /proc/driver/nvidia/version shows; `reboots` receives the reboot reasons declared."""
    from spec.load import load_spec_file

    called: list[str] = []
    for name in ("fetch_source", "check_installer", "build_modules", "install_modules", "clean_builds",
                 "install_userspace", "verify_versions", "link_unit"):
        monkeypatch.setattr(ops, name, lambda *a, _n=name, **kw: called.append(_n))
    # the depmod handler, flushed by the stage: which command, why (the stamps as given)
    monkeypatch.setattr(ops.handlers, "run_handler",
                        lambda **kw: called.append(f"{kw['command']} ({'; '.join(kw['reasons']) or 'no reason'})"))
    monkeypatch.setattr(ops.handlers, "fact_once", lambda fact, **kw: stamps or {})
    said: list[str] = []
    monkeypatch.setattr(ops.logger, "info", said.append)
    host_state = state or {"running": "6.1.0-57-amd64", "releases": {}, "sources": {}, "persistenced": {}}
    monkeypatch.setattr(ops, "_state_and_steps", lambda spec: (host_state, releases or ["6.1.0-57-amd64"], steps))
    monkeypatch.setattr(ops, "fact_once", lambda fact, **kw: {"nvidia_driver": {"version": loaded} if loaded else None})
    spec = load_spec_file(ROOT / "inventories" / "kpro6.yml")["kpro6"]
    assert spec.nvidia is not None
    # the example leaves modules_source for the operator to fill in (no published sha256 of the archive)
    modules = SourceSpec(url="https://github.com/NVIDIA/open-gpu-kernel-modules/archive/refs/tags/595.71.05.tar.gz",
                         sha256=SHA)
    spec = spec.model_copy(update={"nvidia": spec.nvidia.model_copy(update={"persistenced": False,
                                                                            "modules_source": modules})})
    fake_state = FakeState()
    with ctx_state.use(fake_state), ctx_host.use(create_host(fake_state)):
        ops.apply._inner(spec)
        if reboots is not None:
            from facts.run_state import reboot_reasons
            reboots.extend(reboot_reasons())
    return called, said


NOTHING_TO_DO: dict = {"jobs": 2, "ccache": True, "fetch_modules": False, "fetch_installer": False,
                 "install_userspace": False, "firmware_files": [], "verify": False, "refusals": [], "notes": [],
                 "releases": {"6.1.0-57-amd64": {"build": False, "cc": "gcc-12", "cxx": None,
                                                 "reason": "nvidia 595.45.04 is installed for 6.1.0-57-amd64"}}}


def test_apply_calls_no_operation_for_steps_the_plan_does_not_run(monkeypatch):
    called, said = _apply_with_steps(monkeypatch, NOTHING_TO_DO)
    assert called == []
    assert any("nvidia 595.45.04 is installed for 6.1.0-57-amd64" in line for line in said)
    assert any("modules, firmware and user space unchanged and equal" in line for line in said)


def test_apply_calls_each_operation_the_plan_runs(monkeypatch):
    steps = {**NOTHING_TO_DO, "fetch_modules": True, "fetch_installer": True, "install_userspace": True,
             "verify": True, "releases": {"6.1.0-57-amd64": {**NOTHING_TO_DO["releases"]["6.1.0-57-amd64"],
                                                             "build": True}}}
    called, _ = _apply_with_steps(monkeypatch, steps)
    assert called == ["fetch_source", "fetch_source", "check_installer", "build_modules", "install_modules", "clean_builds",
                      "depmod -- 6.1.0-57-amd64 (nvidia 595.71.05 modules installed for 6.1.0-57-amd64)",
                      "install_userspace", "verify_versions"]


TWO_RELEASES = ["6.1.0-57-amd64", "6.14.8-2-pve"]


def _two_releases(monkeypatch, build: dict, stamps: dict | None = None) -> list[str]:
    """apply for two target releases (kpro6's nvidia 595.71.05), `build` saying which are built this
    run; both have our module on the host already."""
    steps = {**NOTHING_TO_DO, "verify": any(build.values()),
             "releases": {r: {**NOTHING_TO_DO["releases"]["6.1.0-57-amd64"], "build": build[r]} for r in TWO_RELEASES}}
    state = {"running": TWO_RELEASES[0], "sources": {}, "persistenced": {},
             "releases": {r: {"module": {"version": "595.71.05"}} for r in TWO_RELEASES}}
    called, _ = _apply_with_steps(monkeypatch, steps, state, stamps, TWO_RELEASES)
    return called


def test_one_depmod_for_every_release_installed_before_the_version_check(monkeypatch):
    """Two releases built: both installed, then ONE depmod operation for both (not one per install),
    and it runs before verify_versions (modinfo -k <release> nvidia reads the index depmod wrote)."""
    called = _two_releases(monkeypatch, {r: True for r in TWO_RELEASES})
    depmod = [c for c in called if c.startswith("depmod ")]
    assert depmod == ["depmod -- 6.1.0-57-amd64 && depmod -- 6.14.8-2-pve (nvidia 595.71.05 modules installed for "
                      "6.1.0-57-amd64; nvidia 595.71.05 modules installed for 6.14.8-2-pve)"]
    assert called.index(depmod[0]) > max(i for i, c in enumerate(called) if c == "install_modules")
    assert called.index(depmod[0]) < called.index("verify_versions")
    install = ops.install_command("595.71.05", TWO_RELEASES[0]).splitlines()
    assert not [line for line in install if line.startswith("depmod")]  # the install script no longer runs it


def test_depmod_retried_from_its_stamp_and_quiet_once_it_matches(monkeypatch):
    """Nothing built: with no depmod stamp (a run that installed modules and stopped before depmod)
    it runs for the releases with our modules; with the stamp of that run it is handed no reason."""
    called = _two_releases(monkeypatch, {r: False for r in TWO_RELEASES})
    assert called == ["depmod -- 6.1.0-57-amd64 && depmod -- 6.14.8-2-pve "
                      "(no /var/lib/pvegpu/depmod.stamp yet (its first run on this host, or a previous run "
                      "stopped before it))"]
    stamp = "".join(f"{hashlib.sha256(b'nvidia 595.71.05').hexdigest()} 755 /lib/modules/{r}/updates/pvegpu-nvidia\n"
                    for r in TWO_RELEASES)
    stamps = {"/var/lib/pvegpu/depmod.stamp": {"mode": "644", "sha256": hashlib.sha256(stamp.encode()).hexdigest()}}
    assert _two_releases(monkeypatch, {r: False for r in TWO_RELEASES}, stamps) == [
        "depmod -- 6.1.0-57-amd64 && depmod -- 6.14.8-2-pve (no reason)"]  # run_handler then noops (handlers tests)


def test_build_command_uses_kernel_compiler_ccache_and_jobs():
    command = ops.build_command("/var/cache/pvegpu/sources/x.tar.xz", "535.309.01", "6.1.0-57-amd64",
                                "gcc-12", 3, ccache=True)
    assert "\nR=6.1.0-57-amd64\n" in command  # the release the script builds for (the kernel hook sets R itself)
    assert '-j3 modules KERNEL_UNAME="$R" CC=gcc-12 ' in command
    assert ("PATH=/usr/lib/ccache:$PATH CCACHE_DIR=/var/cache/pvegpu/ccache CCACHE_DEPEND=1 "
            "CCACHE_IGNOREOPTIONS='-DKBUILD_BASENAME=\"#conftest* -DKBUILD_MODNAME=\"#conftest*' make") in command
    plain = ops.build_command("/a", "1", "r", "gcc-12", 1, ccache=False, conftest_cache=False)
    assert "CC=gcc-12" in plain and "ccache" not in plain and "conftest" not in plain


@pytest.mark.skipif(not Path("/usr/lib/ccache/gcc").exists(), reason="needs ccache's masquerade dir (apt install ccache)")
def test_a_build_under_another_locale_hits_the_cache(tmp_path, monkeypatch):
    """The kernel hook builds under apt in the operator's session (LANG sent over ssh), the converge
    without LANG; ccache hashes the locale variables, so the script fixes them: the second build,
    under another LANG, is answered from the cache (real ccache and gcc; on the code before, 2 misses).
    The cold compile takes its key from kbuild's -Wp,-MMD file (depend mode), not a second preprocessor
    run (ccache's debug log; on the code before: "Running preprocessor")."""
    archive, env = conftest_build(tmp_path, monkeypatch)
    monkeypatch.setattr(ops, "CCACHE_DIR", str(tmp_path / "ccache"))
    (tmp_path / "a.c").write_text("int twice(int x) { return 2 * x; }\n")
    make = Path(env["PATH"].split(":")[0]) / "make"  # the fake make compiles one file with the build's $PATH gcc
    make.write_text(f"#!/bin/sh\nset -e\ncd \"$2\"\ngcc -Wp,-MMD,.a.o.d -c {tmp_path / 'a.c'} -o a.o\nmkdir -p conftest\ntouch nvidia.ko\n")
    command = ops.build_command(str(archive), "535.309.01", "6.1.0-57-amd64", "gcc", 2, ccache=True, conftest_cache=False)
    for lang in (None, "C.UTF-8"):
        run_env = {k: v for k, v in env.items() if k not in ("LANG", "LC_ALL", "LC_CTYPE", "LC_MESSAGES")}
        if lang:
            run_env["LANG"] = lang
        else:
            run_env["CCACHE_DEBUG"] = "1"  # the cold compile's log lands beside a.o (kept in the build's tree)
            run_env["CCACHE_DEBUGDIR"] = str(tmp_path / "ccache-debug")
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=run_env)
        assert done.returncode == 0, done.stderr
    [log] = (tmp_path / "ccache-debug").rglob("*.ccache-log")
    assert "Got result key from dependency file" in log.read_text(), log.read_text()[-2000:]
    stats = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True, check=True,
                           env={**os.environ, "CCACHE_DIR": str(tmp_path / "ccache")}).stdout
    counters = dict(line.split("\t") for line in stats.splitlines() if "\t" in line)
    assert (int(counters["cache_miss"]), int(counters["direct_cache_hit"])) == (1, 1), stats


def test_conftest_pid_in_cflags_does_not_defeat_ccache(tmp_path):
    """Two builds' conftests differ only in -DKBUILD_BASENAME="#conftest<pid>": the second hits."""
    # kernel headers expand KBUILD_MODNAME (module.h, printk.h), so it reaches the object
    (tmp_path / "t.c").write_text("const char *modname = KBUILD_MODNAME;\n")
    env = {**os.environ, "CCACHE_DIR": str(tmp_path / "cache"), "CCACHE_IGNOREOPTIONS": ops.CCACHE_IGNORE_OPTIONS}

    def compile_with(pid, module=None):
        name = module or f"#conftest{pid}"
        subprocess.run(["ccache", "gcc", "-O2", f'-DKBUILD_BASENAME="{name}"', f'-DKBUILD_MODNAME="{name}"',
                        "-c", str(tmp_path / "t.c"), "-o", str(tmp_path / "t.o")], check=True, env=env, cwd=tmp_path)
        stats = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True, env=env).stdout
        return {k: int(v) for k, v in (line.split("\t") for line in stats.splitlines()) if k.endswith(("_hit", "miss"))}

    compile_with(383)
    assert compile_with(29871)["direct_cache_hit"] == 1
    assert compile_with(0, module="nvidia_uvm")["cache_miss"] == 2, "a real module name must stay in the hash"


def conftest_key(archive, cc, modules_dir, release="6.1.0-57-amd64", make_args="modules CC=gcc"):
    command = ops.conftest_key_command(str(archive), release, cc, make_args, modules_dir=str(modules_dir))
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.strip()


def test_conftest_key_changes_with_archive_headers_and_compiler(tmp_path):
    archive = tmp_path / "nvidia.tar.xz"
    archive.write_bytes(b"tree 1")
    build = tmp_path / "modules/6.1.0-57-amd64/build"
    (build / "include/config").mkdir(parents=True)
    (build / "include/config/auto.conf").write_text("CONFIG_CC_VERSION_TEXT=\"gcc-12 (Debian 12.2.0-14) 12.2.0\"\n")
    (build / "include/linux").mkdir()
    (build / "include/linux/mm.h").write_text("struct page;\n")
    modules = tmp_path / "modules"
    key = conftest_key(archive, "gcc", modules)
    assert len(key) == 64 and key == conftest_key(archive, "gcc", modules), "the key is stable"
    archive.write_bytes(b"tree 2")
    assert conftest_key(archive, "gcc", modules) != key, "another source archive"
    archive.write_bytes(b"tree 1")
    (build / "include/linux/mm.h").write_text("struct page; struct folio;\n")
    assert conftest_key(archive, "gcc", modules) != key, "a changed kernel header"
    (build / "include/linux/mm.h").write_text("struct page;\n")
    os.utime(build / "include/linux/mm.h", (1, 1))
    assert conftest_key(archive, "gcc", modules) != key, "a re-installed header (another mtime)"
    os.utime(build / "include/linux/mm.h", (2, 2))
    settled = conftest_key(archive, "gcc", modules)
    (build / "include/config/auto.conf").write_text("CONFIG_CC_VERSION_TEXT=\"gcc-13\"\n")
    os.utime(build / "include/config/auto.conf", (3, 3))
    other = conftest_key(archive, "gcc", modules)
    assert other != settled, "another kernel config"
    assert conftest_key(archive, "gcc", modules, release="6.1.0-58-amd64") != other, "another release"
    assert conftest_key(archive, "gcc", modules, make_args="modules CC=gcc NV_VERBOSE=1") != other, "other make variables"
    fake_cc = tmp_path / "bin/gcc-99"
    fake_cc.parent.mkdir()
    fake_cc.write_text("#!/bin/sh\necho 'gcc version 99.1.0'\n")
    fake_cc.chmod(0o755)
    assert conftest_key(archive, str(fake_cc), modules) != other, "another compiler"


# `modinfo -F FIELD FILE` as kmod answers it for a module of $VER built for $REL (one line per
# value: nvidia.ko declares one MODULE_FIRMWARE per GSP file, kernel-open/nvidia/nv.c)
FAKE_MODINFO = """#!/bin/sh
case "$2" in
  vermagic) echo "$REL SMP preempt mod_unload modversions ";;
  version) echo "$VER";;
  firmware) echo "nvidia/$VER/gsp_ga10x.bin"; echo "nvidia/$VER/gsp_tu10x.bin";;
esac
"""


def fake_build_tools(tmp_path):
    """A `make` that runs the conftest step only when conftest/ is absent, a `modinfo` for vermagic."""
    bindir = tmp_path / "tools"
    bindir.mkdir()
    (bindir / "make").write_text(
        "#!/bin/sh\nset -e\ncd \"$2\"\n"
        "if [ -f conftest/functions.h ]; then echo reused >> \"$LOG\"; "
        "else mkdir -p conftest; echo '#define NV_FOO_PRESENT' > conftest/functions.h; echo ran >> \"$LOG\"; fi\n"
        "touch nvidia.ko\n")
    (bindir / "modinfo").write_text(FAKE_MODINFO)
    (bindir / "strip").write_text("#!/bin/sh\necho \"strip $*\" >> \"$LOG.strip\"\n")  # the fake .ko is no ELF
    for tool in ("make", "modinfo", "strip"):
        (bindir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "LOG": str(tmp_path / "conftest.log"),
            "REL": "6.1.0-57-amd64", "VER": "535.309.01"}


def conftest_build(tmp_path, monkeypatch):
    """A one-Kbuild source archive, build and conftest cache dirs under tmp_path, fake make/modinfo:
    (archive path, environment)."""
    return nvidia_kernel_archive(tmp_path, monkeypatch), fake_build_tools(tmp_path)


def test_build_restores_conftest_results_only_for_the_same_key(tmp_path, monkeypatch):
    archive, env = conftest_build(tmp_path, monkeypatch)

    def build(cc="gcc", conftest_cache=True):
        command = ops.build_command(str(archive), "535.309.01", "6.1.0-57-amd64", cc, 2, ccache=False,
                                    conftest_cache=conftest_cache)
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, check=True).stdout

    assert "restored" not in build()
    assert len(list((tmp_path / "conftest-cache").glob("*.tgz"))) == 1, "a successful build stores its results"
    assert "conftest results restored" in build()
    assert "conftest results restored" not in build(cc="cc"), "another compiler runs the tests again"
    build(conftest_cache=False)
    assert (tmp_path / "conftest.log").read_text().split() == ["ran", "reused", "ran", "ran"]
    assert len(list((tmp_path / "conftest-cache").glob("*.tgz"))) == 2


def test_build_drops_a_damaged_conftest_archive(tmp_path, monkeypatch):
    archive, env = conftest_build(tmp_path, monkeypatch)
    command = ops.build_command(str(archive), "535.309.01", "6.1.0-57-amd64", "gcc", 2, ccache=False)
    subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, check=True)
    [stored] = (tmp_path / "conftest-cache").glob("*.tgz")
    stored.write_bytes(stored.read_bytes()[:-12])  # truncated: the last bytes never reached the disk
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, check=True).stdout
    assert "restored" not in out
    assert (tmp_path / "conftest.log").read_text().split() == ["ran", "ran"]
    assert stored.exists() and subprocess.run(["tar", "-tzf", str(stored)], capture_output=True).returncode == 0, \
        "the rebuilt results replace the damaged archive"


def fake_modinfo(tmp_path, version):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "modinfo").write_text(f"#!/bin/sh\n[ -n '{version}' ] && echo '{version}'\n")
    (bindir / "modinfo").chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


def test_verify_passes_when_module_matches(tmp_path):
    result = sh(ops.verify_command("535.309.01", ["6.1.0-57-amd64"], firmware=False), env=fake_modinfo(tmp_path, "535.309.01"))
    assert result.returncode == 0, result.stderr


def test_verify_refuses_to_finish_on_mismatch(tmp_path):
    result = sh(ops.verify_command("535.309.01", ["6.1.0-57-amd64"], firmware=True), env=fake_modinfo(tmp_path, "535.261.03"))
    assert result.returncode == 1
    assert "kernel 6.1.0-57-amd64: nvidia module is '535.261.03', want 535.309.01" in result.stderr
    if not list(Path("/lib/firmware/nvidia").glob("535.309.01/gsp*.bin")):
        assert "GSP firmware 535.309.01 missing" in result.stderr
    assert "the stage did not finish" in result.stderr


def test_open_tree_src_built_once_for_two_releases_stripped_then_signed(tmp_path, monkeypatch):
    """The open tree's layout (src/nvidia, src/nvidia-modeset, kernel-open/): src/ is made once and
    shared; each release gets its own kernel-open/; modules are stripped, then signed."""
    monkeypatch.setattr(ops, "BUILD_ROOT", str(tmp_path / "build"))
    monkeypatch.setattr(ops, "CONFTEST_CACHE", str(tmp_path / "conftest-cache"))
    top = tmp_path / "tree/open-gpu-kernel-modules-595.71.05"
    for d in ("src/nvidia", "src/nvidia-modeset", "kernel-open/nvidia", "kernel-open/nvidia-modeset"):
        (top / d).mkdir(parents=True)
    (top / "kernel-open/Kbuild").write_text("obj-m += nvidia.o\n")
    archive = tmp_path / "open.tar"
    subprocess.run(["tar", "-C", str(tmp_path / "tree"), "-cf", str(archive), top.name], check=True)
    env = fake_build_tools(tmp_path)
    bindir = Path(env["PATH"].split(":")[0])
    # make: the top-level .o_binary targets build src/ (as the tree's Makefile links them); else kernel-open
    (bindir / "make").write_text(
        "#!/bin/sh\nset -e\ncd \"$2\"\necho \"make $*\" >> \"$LOG.make\"\n"
        "case \"$*\" in *nv-kernel.o_binary*) mkdir -p src/nvidia/_out src/nvidia-modeset/_out; "
        "echo obj > src/nvidia/_out/nv-kernel.o; echo obj > src/nvidia-modeset/_out/nv-modeset-kernel.o; "
        "ln -sf ../../src/nvidia/_out/nv-kernel.o kernel-open/nvidia/nv-kernel.o_binary; "
        "ln -sf ../../src/nvidia-modeset/_out/nv-modeset-kernel.o kernel-open/nvidia-modeset/nv-modeset-kernel.o_binary; exit 0;; esac\n"
        "[ -e nvidia/nv-kernel.o_binary ] && [ -e nvidia-modeset/nv-modeset-kernel.o_binary ] || { echo 'no o_binary' >&2; exit 1; }\n"
        "mkdir -p conftest; touch nvidia.ko nvidia-uvm.ko\n")
    (bindir / "sign-file").write_text("#!/bin/sh\necho \"sign $*\" >> \"$LOG.strip\"\n")
    (bindir / "sign-file").chmod(0o755)
    key = tmp_path / "mok.key"  # root's alone, as the build's key check wants (issue 39 item 4)
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    key.chmod(0o600)
    outs = []
    for release in ("6.1.0-57-amd64", "6.12.118+deb12-amd64"):
        modules = tmp_path / "lib/modules" / release / "build/scripts"
        modules.mkdir(parents=True)
        (modules / "sign-file").symlink_to(bindir / "sign-file")
        command = ops.build_command(str(archive), "595.71.05", release, "gcc-12", 2, ccache=False, cxx="g++-12",
                                    signing=(str(key), "/root/mok.der"))
        command = command.replace("/lib/modules/", str(tmp_path / "lib/modules") + "/")
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env={**env, "REL": release, "VER": "595.71.05"})
        assert done.returncode == 0, done.stderr
        outs.append(done.stdout)
        assert sorted(p.name for p in (tmp_path / "build/595.71.05" / release / "out").iterdir()) == ["nvidia-uvm.ko", "nvidia.ko"]
    makes = (tmp_path / "conftest.log.make").read_text().splitlines()
    assert sum("nv-kernel.o_binary" in m for m in makes) == 1, makes
    assert "CC=gcc-12 CXX=g++-12" in makes[0]
    assert "src/ objects reused" not in outs[0] and "src/ objects reused" in outs[1]
    steps = (tmp_path / "conftest.log.strip").read_text().splitlines()
    assert steps[0].startswith("strip --strip-debug") and steps[1].startswith(f"sign sha256 {key} /root/mok.der")
    assert [s.split()[0] for s in steps] == ["strip", "sign", "sign"] * 2
    assert not (tmp_path / "build/595.71.05/6.1.0-57-amd64/kernel-open").exists()
    subprocess.run(["sh", "-c", ops.cleanup_command("595.71.05")], check=True)
    assert not (tmp_path / "build/595.71.05").exists()


def test_persistenced_is_enabled_through_the_one_wants_link_operation(monkeypatch):
    """The NVIDIA stage and the module-options stage make systemd wants links with the same
    operation (operations.files.link_unit; issue 18 part 3); an enabled unit gets none."""
    calls = []
    monkeypatch.setattr(ops, "link_unit", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ops.logger, "info", lambda line: None)
    unit = "/usr/lib/systemd/system/nvidia-persistenced.service"  # the user space installed it
    fake_state = FakeState()
    with ctx_state.use(fake_state), ctx_host.use(create_host(fake_state)):
        ops._persistenced({"persistenced": {"unit": unit, "enabled": False, "binary": True}}, will_install=False)
        ops._persistenced({"persistenced": {"unit": unit, "enabled": True, "binary": True}}, will_install=False)
    assert calls == [{"name": "Enable nvidia-persistenced", "current": None, "target": unit,
                      "link": "/etc/systemd/system/multi-user.target.wants/nvidia-persistenced.service"}]


def test_a_written_persistenced_unit_declares_the_daemon_reload(monkeypatch):
    """No unit from the user space: the stage writes /etc/systemd/system/nvidia-persistenced.service
    and declares it to the daemon-reload handler (a reason when it is written this run)."""
    from facts.run_state import run_state
    from operations import handlers

    written = []
    monkeypatch.setattr(ops, "managed_file", lambda **kw: written.append(kw["path"]))
    monkeypatch.setattr(ops, "link_unit", lambda **kw: None)
    monkeypatch.setattr(ops.logger, "info", lambda line: None)
    pers = {"persistenced": {"unit": None, "enabled": False, "binary": True}}
    for files, reasons in (({}, ["nvidia-persistenced unit changed"]), (None, [])):
        fake_state = FakeState()
        content = ops.render_template("nvidia-persistenced.service.j2")
        current = {"mode": "644", "sha256": hashlib.sha256(content.encode()).hexdigest()}
        found = files if files is not None else {ops.PERSISTENCED_UNIT: current}
        fake = create_host(fake_state, facts={"files.ManagedFiles": {f"paths={[ops.PERSISTENCED_UNIT]!r}": found}})
        with ctx_state.use(fake_state), ctx_host.use(fake):
            ops._persistenced(pers, will_install=False)
        entry = run_state(fake).handlers[handlers.DAEMON_RELOAD]
        assert list(entry["inputs"]) == [ops.PERSISTENCED_UNIT] and entry["reasons"] == reasons
    assert written == [ops.PERSISTENCED_UNIT] * 2


# -- version identity before install (issue 28 part 1) --------------------------------------

def _tiny_tree(tmp_path, version_mk: str | None):
    """A one-Kbuild tree (with version.mk when given) and the fake build tools: (archive, env)."""
    top = tmp_path / "tree/open-gpu-kernel-modules"
    top.mkdir(parents=True)
    (top / "Kbuild").write_text("obj-m += nvidia.o\n")
    if version_mk is not None:
        (top / "version.mk").write_text(version_mk)
    archive = tmp_path / "tree.tar"
    subprocess.run(["tar", "-C", str(tmp_path / "tree"), "-cf", str(archive), top.name], check=True)
    return archive, fake_build_tools(tmp_path)


def _build(tmp_path, monkeypatch, archive, env, version="595.71.05"):
    monkeypatch.setattr(ops, "BUILD_ROOT", str(tmp_path / "build"))
    monkeypatch.setattr(ops, "CONFTEST_CACHE", str(tmp_path / "conftest-cache"))
    command = ops.build_command(str(archive), version, "6.1.0-57-amd64", "gcc", 2, ccache=False)
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def test_a_tree_of_another_version_stops_before_any_compile(tmp_path, monkeypatch):
    """A 595.45.04 tree configured as 595.71.05: refused from its version.mk, `make` never runs."""
    archive, env = _tiny_tree(tmp_path, "NVIDIA_VERSION = 595.45.04\nNVIDIA_NVID_VERSION = 595.45.04\n")
    done = _build(tmp_path, monkeypatch, archive, {**env, "VER": "595.45.04"})
    assert done.returncode == 1
    assert "is version '595.45.04' (its version.mk NVIDIA_VERSION), but nvidia.version is 595.71.05" in done.stderr
    assert not (tmp_path / "conftest.log").exists(), "make ran"
    archive, env = _tiny_tree(tmp_path / "same", "NVIDIA_VERSION = 595.71.05\n")
    assert _build(tmp_path / "same", monkeypatch, archive, {**env, "VER": "595.71.05"}).returncode == 0


def test_built_modules_of_another_version_are_not_installed(tmp_path, monkeypatch):
    """A tree without version.mk (Debian's module source, an extracted .run) whose modules say
    another MODULE_VERSION: the build fails naming both, before the install step."""
    archive, env = _tiny_tree(tmp_path, None)
    done = _build(tmp_path, monkeypatch, archive, {**env, "VER": "595.45.04"})
    assert done.returncode == 1
    assert "built module nvidia.ko is version '595.45.04', but nvidia.version is 595.71.05" in done.stderr
    assert (tmp_path / "conftest.log").exists(), "the check follows the compile"


def test_built_nvidia_ko_asking_for_other_firmware_is_not_installed(tmp_path, monkeypatch):
    archive, env = _tiny_tree(tmp_path, None)
    bindir = Path(env["PATH"].split(":")[0])
    (bindir / "modinfo").write_text(FAKE_MODINFO.replace('"nvidia/$VER/gsp_tu10x.bin"', '"nvidia/595.45.04/gsp_tu10x.bin"'))
    done = _build(tmp_path, monkeypatch, archive, {**env, "VER": "595.71.05"})
    assert done.returncode == 1
    assert "asks for firmware nvidia/595.45.04/gsp_tu10x.bin, not under nvidia/595.71.05/" in done.stderr


def test_an_installer_of_another_version_is_refused_before_anything_is_built(tmp_path):
    """The twin's .run stand-in answers --version as nvidia-installer does; the check reads it."""
    from tests.twin import installer

    run = str(installer.build("595.45.04", tmp_path))
    bad = sh(ops.installer_version_command(run, "595.71.05"))
    assert bad.returncode == 1
    assert f"the NVIDIA installer {run} is version '595.45.04', but nvidia.version is 595.71.05" in bad.stderr
    assert sh(ops.installer_version_command(run, "595.45.04")).returncode == 0
    junk = tmp_path / "not-a-run"
    junk.write_text("echo hello\n")
    assert "is version 'unknown'" in sh(ops.installer_version_command(str(junk), "595.45.04")).stderr


def test_userspace_install_passes_when_nouveau_is_bound(tmp_path):
    """A GPU still on nouveau (given to a VM, blacklisted for the next boot): the installer call the
    stage makes installs; the call without --no-nouveau-check is refused as nvidia-installer does,
    leaving its own modprobe.d blacklist behind."""
    from tests.twin import installer

    run = str(installer.build("595.71.05", tmp_path))
    env = {**os.environ, "PVEGPU_TWIN_INSTALL_ROOT": str(tmp_path / "root")}
    (tmp_path / "root/sys/bus/pci/drivers/nouveau").mkdir(parents=True)
    (tmp_path / "root/sys/bus/pci/devices/0000:81:00.0").mkdir(parents=True)
    (tmp_path / "root/sys/bus/pci/devices/0000:81:00.0/driver").symlink_to("../../drivers/nouveau")
    (tmp_path / "root/etc/modprobe.d").mkdir(parents=True)
    old = sh(f"sh {run} --silent --no-kernel-modules", env=env)
    assert old.returncode == 1 and "nouveau" in old.stderr
    assert (tmp_path / "root/etc/modprobe.d/nvidia-installer-disable-nouveau.conf").read_text().splitlines()[1:] == [
        "blacklist nouveau", "options nouveau modeset=0"]
    assert not (tmp_path / "root/usr/lib/x86_64-linux-gnu").exists()
    (tmp_path / "root/etc/modprobe.d/nvidia-installer-disable-nouveau.conf").unlink()
    done = sh(ops.userspace_command(run), env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.595.71.05").exists()
    assert (tmp_path / "root/lib/firmware/nvidia/595.71.05/gsp_ga10x.bin").exists()
    assert not (tmp_path / "root/etc/modprobe.d/nvidia-installer-disable-nouveau.conf").exists()


# -- a driver upgrade declares its reboot (issue 28 part 3) ----------------------------------

def test_an_upgrade_over_a_loaded_older_driver_declares_a_reboot(monkeypatch):
    """595.45.04 loaded, 595.71.05 built and installed for the running kernel this run: the stage
    declares a reboot (the reboot stage then reboots or says it is pending); the same run with the
    new driver loaded, or with nothing loaded, declares none."""
    steps = {**NOTHING_TO_DO, "install_userspace": True, "verify": True,
             "releases": {"6.1.0-57-amd64": {**NOTHING_TO_DO["releases"]["6.1.0-57-amd64"], "build": True}}}
    reboots: list = []
    _apply_with_steps(monkeypatch, steps, loaded="595.45.04", reboots=reboots)
    assert reboots == [("nvidia", "nvidia 595.45.04 is loaded but 595.71.05 is installed for 6.1.0-57-amd64; "
                                  "nvidia-smi and CUDA fail with 'Driver/library version mismatch' until the new "
                                  "module is loaded")]
    for loaded in ("595.71.05", None):
        reboots = []
        _apply_with_steps(monkeypatch, steps, loaded=loaded, reboots=reboots)
        assert reboots == []
