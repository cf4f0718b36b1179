"""The kernel build path before any build starts (issue 27 part 4): the Debian packages the build
runs are checked and installed by the stage (or refused when apt has none), free space is checked
against the measured figure, pve-kernel's own Build-Depends are installed (or named) before the
submodules are fetched, and the kernel's ccache is its own and hits across refs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from facts import kernel as kernel_facts
from operations import kernel
from operations import nvidia as nvidia_ops
from plan import kernel as plan
from spec.models import HostSpec, KernelSpec
from tests.e2e.test_driver_build import ccache_counters
from tests.unit.operations.oprun import run_op
from tests.unit.pve_kernel_tree import bookworm_git_tree

REPO = Path(__file__).resolve().parents[2]
REF = "ad58d1445425ea4742e3470b2edbee35df0657e9"
RELEASE = "6.14.11-9-bpo12-pvegpu-pve"
GIT = {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": REF}
GIB = plan.GIB_KIB
OLD = "6.14.8-2-pve"


def sh(cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, **kw)


def stage_facts(needs_lines: list[str]) -> dict:
    return {"kernels": {"running": OLD, "installed": [OLD], "pinned": None, "next_boot": None},
            "build": kernel_facts.parse_build_state(["pbt", "esps", "uefi"]),
            "source": None, "needs": kernel_facts.parse_build_needs(needs_lines)}


def preflight(monkeypatch, spec: HostSpec, needs_lines: list[str]) -> list[str]:
    monkeypatch.setattr(kernel, "stage_facts", lambda k: stage_facts(needs_lines))
    monkeypatch.setattr(kernel, "host", SimpleNamespace(name="kpro6"))
    return kernel.preflight(spec)


ALL_TOOLS = [f"installed {t}" for t in (*plan.PROXMOX_GIT_TOOLS, "ccache")]


# -- build dependencies ---------------------------------------------------------------------

def test_the_tools_each_build_runs():
    git = plan.build_tools(KernelSpec(version=RELEASE, source=GIT))
    assert git == ["git", "make", "dpkg-dev", "build-essential", "devscripts", "equivs", "ccache"]
    local = KernelSpec(version="6.1.192-x", source={"kind": "tarball", "url": "/srv/linux.tar.xz", "sha256": "a" * 64},
                       ccache=False)
    assert "curl" not in plan.build_tools(local) and "ccache" not in plan.build_tools(local)
    assert {"bc", "bison", "flex", "libelf-dev", "libssl-dev", "rsync", "kmod", "cpio", "dpkg-dev"} <= set(plan.build_tools(local))
    remote = local.model_copy(update={"source": local.source.model_copy(update={"url": "https://cdn.kernel.org/l.tar.xz"})})
    assert "curl" in plan.build_tools(remote)
    # the fact is asked about exactly these
    assert kernel.fact_args(KernelSpec(version=RELEASE, source=GIT), "running")["tools"] == " ".join(git)


def test_the_needs_fact_on_this_machine(tmp_path):
    """The fact's own command, run here: dpkg's view of installed packages, apt's candidates for
    the missing ones only, df of the nearest existing parent."""
    command = kernel_facts.build_needs_command(["dpkg", "pvegpu-no-such-package"], RELEASE, str(tmp_path / "a/b/c"))
    needs = kernel_facts.parse_build_needs(sh(command).stdout.splitlines())
    assert needs["installed"] == ["dpkg"] and needs["candidates"] == {"pvegpu-no-such-package": None}
    assert needs["free_path"] == str(tmp_path)
    assert abs(needs["free_kib"] - shutil.disk_usage(tmp_path).free // 1024) < GIB  # others write there too
    # a build of the release is installed: apt is not asked (a converged host pays nothing)
    manifest = tmp_path / "installed.json"
    manifest.write_text("{}")
    asked = command.replace(f"{plan.STATE_DIR}/{RELEASE}.json", str(manifest))
    assert asked != command
    needs = kernel_facts.parse_build_needs(sh(asked).stdout.splitlines())
    assert needs["unasked"] == ["pvegpu-no-such-package"] and needs["candidates"] == {}


def test_missing_tools_are_installed_by_the_stage_before_the_build(monkeypatch):
    k = KernelSpec(version=RELEASE, source=GIT)
    lines = [line for line in ALL_TOOLS if line not in ("installed devscripts", "installed equivs")]
    lines += ["candidate devscripts 2.23.4+deb12u2", "candidate equivs 2.3.1", f"free {40 * GIB} /var/lib"]
    needs = kernel_facts.parse_build_needs(lines)
    assert plan.missing_tools(k, needs) == (["devscripts", "equivs"], [])
    assert preflight(monkeypatch, HostSpec(kernel=k.model_dump()), lines) == []
    monkeypatch.undo()
    cmds, noop = run_op(kernel.install_build_tools, ["devscripts", "equivs"])
    assert noop is None and len(cmds) == 1
    assert cmds[0].startswith("DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends devscripts equivs ")
    # apt cannot install them: the op fails, naming them
    failing = sh(cmds[0].replace("apt-get install", "false"))
    assert failing.returncode == 1 and "apt could not install devscripts equivs" in failing.stderr
    assert run_op(kernel.install_build_tools, [])[0] == []


def test_preflight_refuses_tools_apt_has_no_candidate_for(monkeypatch):
    k = KernelSpec(version=RELEASE, source=GIT)
    lines = [line for line in ALL_TOOLS if line != "installed equivs"] + ["candidate equivs ", f"free {40 * GIB} /var/lib"]
    refusals = preflight(monkeypatch, HostSpec(kernel=k.model_dump()), lines)
    assert len(refusals) == 1 and "needs equivs, not installed, and apt has no candidate for it" in refusals[0]
    # not asked (a build of this release is installed): left to apt-get, which names them if it cannot
    unasked = [line for line in ALL_TOOLS if line != "installed equivs"] + ["unasked equivs", f"free {40 * GIB} /"]
    assert plan.missing_tools(k, kernel_facts.parse_build_needs(unasked)) == (["equivs"], [])


# -- free space -----------------------------------------------------------------------------

def test_preflight_refuses_a_build_without_the_space_it_needs(monkeypatch):
    k = KernelSpec(version=RELEASE, source=GIT)
    lines = [*ALL_TOOLS, f"free {10 * GIB} /var/lib"]
    refusals = preflight(monkeypatch, HostSpec(kernel=k.model_dump()), lines)
    assert len(refusals) == 1, refusals
    assert ("needs 32.0 GiB free under /var/lib/pvegpu/kernel-build, and the file system of /var/lib has 10.0 GiB free"
            in refusals[0])
    assert preflight(monkeypatch, HostSpec(kernel=k.model_dump()), [*ALL_TOOLS, f"free {33 * GIB} /var/lib"]) == []
    tiny = KernelSpec(version="6.1.192-x", base_config="tinyconfig", ccache=False,
                      source={"kind": "tarball", "url": "/srv/linux.tar.xz", "sha256": "a" * 64})
    assert plan.build_space_kib(tiny, "tinyconfig") < plan.build_space_kib(tiny, "running") < plan.build_space_kib(k)


def test_nothing_is_refused_when_no_build_is_coming(monkeypatch):
    """The kernel is installed from our build: neither tools nor space matter."""
    k = KernelSpec(version=RELEASE, source=GIT)
    facts = stage_facts([f"free {GIB} /var/lib", "candidate equivs "])
    facts["kernels"].update(running=RELEASE, installed=[OLD, RELEASE], pinned=RELEASE)
    facts["build"]["installed_manifest"] = {"build_id": plan.build_id(k, "running")}
    monkeypatch.setattr(kernel, "stage_facts", lambda _: facts)
    monkeypatch.setattr(kernel, "host", SimpleNamespace(name="kpro6"))
    assert kernel.preflight(HostSpec(kernel=k.model_dump())) == []


# -- pve-kernel's Build-Depends, before the submodules ---------------------------------------

@pytest.fixture(scope="module")
def pve_kernel(tmp_path_factory) -> Path:
    return bookworm_git_tree(tmp_path_factory)


@pytest.mark.skipif(not shutil.which("dpkg-checkbuilddeps"), reason="needs dpkg-dev")
def test_build_stops_naming_the_build_depends_apt_could_not_install(pve_kernel, tmp_path):
    """The real build.sh on the real tree (release check passes): debian/control is generated
    (real make debian.prepared), dpkg-checkbuilddeps (real) finds pve-kernel's Build-Depends this
    machine lacks, mk-build-deps (a stand-in: apt could not install them) fails, and the build
    stops with the list before any submodule is fetched or anything is built."""
    build = tmp_path / "b"
    build.mkdir()
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "mk-build-deps").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/mk-build-deps.args\nexit 1\n")
    (stubs / "mk-build-deps").chmod(0o755)
    head = subprocess.run(["git", "-C", str(pve_kernel), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    k = KernelSpec(version=RELEASE, source={"kind": "proxmox-git", "url": str(pve_kernel), "ref": head}, ccache=False)
    (build / "build.sh").write_text(kernel.build_script(k, "running", 2, str(build)))
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"}
    r = subprocess.run(["sh", str(build / "build.sh")], capture_output=True, text=True, timeout=300, env=env)
    log = (build / "build.log").read_text()
    unmet = subprocess.run(["dpkg-checkbuilddeps", "debian/control"], cwd=build / "src/proxmox-kernel-6.14.11",
                           capture_output=True, text=True)
    if unmet.returncode == 0:
        pytest.skip("this machine has every Build-Depends of pve-kernel")
    assert r.returncode == 7 and (build / "build.rc").read_text().strip() == "7", log[-3000:]
    assert f"pvegpu: pve-kernel at {head}: apt could not install its build dependencies (" in log
    assert "Unmet build dependencies: " in log and "nothing was built" in log
    assert "proxmox-kernel-6.14.11/debian/control" in (tmp_path / "mk-build-deps.args").read_text()
    assert "--no-remove" in (tmp_path / "mk-build-deps.args").read_text()
    assert "submodule" not in log and "dpkg-buildpackage" not in log
    assert not (build / "src/submodules/ubuntu-kernel/README").exists()


# -- ccache -----------------------------------------------------------------------------------

def ccache_env(script: str) -> dict[str, str]:
    """The CCACHE_* variables build.sh exports, run through a real shell."""
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export CCACHE_"))
    out = sh(f"{exports}\nenv").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if line.startswith("CCACHE_"))


def test_the_kernel_ccache_is_its_own():
    k = KernelSpec(version=RELEASE, source=GIT)
    env = ccache_env(kernel.build_script(k, "running", 2, "/var/lib/pvegpu/kernel-build/x"))
    assert env["CCACHE_DIR"] == plan.CCACHE_DIR != nvidia_ops.CCACHE_DIR
    assert not plan.CCACHE_DIR.startswith(nvidia_ops.CCACHE_DIR + "/")
    assert env["CCACHE_MAXSIZE"] == plan.CCACHE_MAX_SIZE
    assert env["CCACHE_BASEDIR"] == "/var/lib/pvegpu/kernel-build/x" and env["CCACHE_NOHASHDIR"] == "true"
    tarball = KernelSpec(version="6.1.192-x", source={"kind": "tarball", "url": "/srv/l.tar.xz", "sha256": "a" * 64})
    assert ccache_env(kernel.build_script(tarball, "tinyconfig", 2, "/b"))["CCACHE_DIR"] == plan.CCACHE_DIR
    assert "CCACHE" not in kernel.build_script(k.model_copy(update={"ccache": False}), "running", 2, "/b")


@pytest.mark.skipif(not shutil.which("ccache") or not shutil.which("gcc"), reason="needs ccache and gcc")
def test_a_second_ref_hits_the_cache(tmp_path, monkeypatch):
    """Two refs build in two build dirs. The same source compiled as Kbuild does (debug info, an
    absolute -I into the tree) in the second dir is a hit with the script's settings (real
    ccache); with only a CCACHE_DIR (the template before) it is a miss: the build dir is in the
    hash."""
    monkeypatch.setattr(plan, "CCACHE_DIR", str(tmp_path / "cache"))
    k = KernelSpec(version=RELEASE, source=GIT)

    def compile_in(build_dir: Path, env: dict[str, str]) -> dict[str, int]:
        src = build_dir / "src"
        (src / "include").mkdir(parents=True)
        (src / "include/pvegpu.h").write_text("#define PVEGPU 1\n")
        (src / "main.c").write_text('#include "pvegpu.h"\nint pvegpu(void) { return PVEGPU; }\n')
        run = {**os.environ, **env}
        subprocess.run(["ccache", "-z"], env=run, check=True, capture_output=True)
        subprocess.run(["ccache", "gcc", "-g", "-O2", f"-I{src}/include", "-c", "main.c", "-o", "main.o"],
                       cwd=src, env=run, check=True, capture_output=True)
        return ccache_counters(subprocess.run(["ccache", "--print-stats"], env=run, capture_output=True, text=True).stdout)

    def hits(counters: dict[str, int]) -> int:
        return counters["direct_cache_hit"] + counters["preprocessed_cache_hit"]

    first, second = tmp_path / "kernel-build/a-111", tmp_path / "kernel-build/b-222"
    assert hits(compile_in(first, ccache_env(kernel.build_script(k, "running", 2, str(first))))) == 0
    assert hits(compile_in(second, ccache_env(kernel.build_script(k, "running", 2, str(second))))) == 1
    # the settings before: one cache dir, nothing else
    old = {"CCACHE_DIR": str(tmp_path / "old-cache")}
    compile_in(tmp_path / "old/a", old)
    assert hits(compile_in(tmp_path / "old/b", old)) == 0
