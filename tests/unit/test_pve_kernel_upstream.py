"""The kernel stage against the real pve-kernel tree (branch bookworm-6.14 at ad58d14, through
scripts/fetch-upstream.sh): the release its Makefile builds, the build script's own release
check with real make, and what job count and compiler its dpkg-buildpackage gives debian/rules
(real dpkg-buildpackage, real debian/rules; the kernel submodule is not needed for that)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from facts import kernel as kernel_facts
from operations import kernel
from plan import kernel as plan
from spec.models import HostSpec, KernelSpec
from tests.unit.pve_kernel_tree import bookworm_git_tree

REPO = Path(__file__).resolve().parents[2]
REF = "ad58d1445425ea4742e3470b2edbee35df0657e9"
UPSTREAM = "6.14.11-9-bpo12-pve"  # Proxmox's KVNAME of that ref
RELEASE = "6.14.11-9-bpo12-pvegpu-pve"  # what our build of it produces (KREL_EXTRA + -pvegpu)
# a target added to debian/rules (make -f debian/rules -f print.mk): what the kernel's make
# would inherit from it: MAKEFLAGS (-jN from DEB_BUILD_OPTIONS parallel=N) and the gcc on PATH
PRINT_MK = ("pvegpu-print:\n\t@echo \"MAKEFLAGS=$(MAKEFLAGS)\"\n\t@echo \"DEB_BUILD_OPTIONS=$(DEB_BUILD_OPTIONS)\"\n"
            "\t@echo \"GCC=$$(command -v gcc)\"\n")


@pytest.fixture(scope="module")
def pve_kernel(tmp_path_factory) -> Path:
    """The real tree as a git repository whose HEAD is ad58d14's content."""
    return bookworm_git_tree(tmp_path_factory)


def test_release_from_the_real_makefile(pve_kernel):
    text = (pve_kernel / "Makefile").read_text()
    assert plan.release_from_makefile(text) == UPSTREAM
    assert plan.built_release_from_makefile(text) == RELEASE
    variables = plan.makefile_variables(text)
    assert (variables["KREL"], variables["KREL_EXTRA"], variables["BUILD_DIR"]) == ("9", "-bpo12", "proxmox-kernel-6.14.11")
    # the same values real make gives (the build script's check), with and without our KREL_EXTRA
    for args, want in (([], UPSTREAM), (["KREL_EXTRA=-bpo12-pvegpu"], RELEASE)):
        made = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", *args,
                               "--eval=pvegpu-kvname: ; @echo $(KVNAME)", "pvegpu-kvname"],
                              cwd=pve_kernel, capture_output=True, text=True, check=True)
        assert made.stdout.strip() == want


def test_our_packages_never_carry_the_names_proxmox_signed_kernel_conflicts_with(pve_kernel, tmp_path):
    """Proxmox's proxmox-kernel-<KVNAME>-signed Conflicts/Replaces proxmox-kernel-<KVNAME>
    (debian/signing-template/control.in): with KREL_EXTRA + -pvegpu on make's command line, the
    prepared debian/control (real make, real debian/rules) names packages of our own release."""
    tree = tmp_path / "tree"
    shutil.copytree(pve_kernel, tree, symlinks=True)
    subprocess.run(["make", "-s", "KREL_EXTRA=-bpo12-pvegpu", "debian.prepared"], cwd=tree, check=True, capture_output=True)
    control = (tree / "proxmox-kernel-6.14.11/debian/control").read_text()
    packages = re.findall(r"^Package: (\S+)$", control, re.M)
    assert f"proxmox-kernel-{RELEASE}" in packages and f"proxmox-headers-{RELEASE}" in packages
    assert not {f"proxmox-kernel-{UPSTREAM}", f"proxmox-headers-{UPSTREAM}"} & set(packages)
    assert f"KVNAME={RELEASE}" in (tree / "proxmox-kernel-6.14.11/debian/rules.d/env.mk").read_text()
    signed = (pve_kernel / "debian/signing-template/control.in").read_text()
    assert "Conflicts: proxmox-kernel-@KVNAME@\n" in signed  # Proxmox's @KVNAME@ is UPSTREAM, never ours


def test_fact_reads_the_makefile_of_the_ref_from_an_earlier_clone(pve_kernel, tmp_path):
    build_root = tmp_path / "kernel-build"
    clone = build_root / "6.14.8-2-pve-0123456789ab" / "src"
    subprocess.run(["git", "clone", "-q", str(pve_kernel), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = kernel_facts.source_makefile_command(str(pve_kernel), head).replace(plan.BUILD_ROOT, str(build_root))
    lines = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()
    assert kernel_facts.parse_source_makefile(lines) == {"release": RELEASE, "from": str(clone)}
    other = kernel_facts.source_makefile_command("git://elsewhere/pve-kernel.git", head).replace(plan.BUILD_ROOT, str(build_root))
    assert subprocess.run(["sh", "-c", other], capture_output=True, text=True).stdout == ""


def test_preflight_refuses_a_version_the_ref_does_not_build():
    k = KernelSpec(version="6.14.8-2-pve", source={"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git",
                                                  "ref": REF})
    refusal = plan.release_refusal(k, RELEASE, "kpro6:/var/lib/pvegpu/kernel-build/x/src")
    assert refusal is not None
    assert "kernel.version is 6.14.8-2-pve" in refusal and f"builds {RELEASE}" in refusal and REF in refusal
    assert plan.release_refusal(k.model_copy(update={"version": RELEASE}), RELEASE, "x") is None


def script(version: str, jobs: int = 3, ccache: bool = True, url: str = "git://git.proxmox.com/git/pve-kernel.git", ref: str = REF, build_dir: str = "/b") -> str:
    k = KernelSpec(version=version, source={"kind": "proxmox-git", "url": url, "ref": ref}, ccache=ccache)
    return kernel.build_script(k, "running", jobs, build_dir)


def test_build_script_refuses_a_version_the_ref_does_not_build_before_fetching_anything(pve_kernel, tmp_path):
    """The script's own check (real git checkout, real make on the real Makefile) stops before
    submodules, build-deps or the build, naming both releases."""
    build = tmp_path / "b"
    build.mkdir()
    head = subprocess.run(["git", "-C", str(pve_kernel), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    text = script("6.14.8-2-pve", ccache=False, url=str(pve_kernel), ref=head, build_dir=str(build))  # no cache dir made here
    (build / "build.sh").write_text(text)
    r = subprocess.run(["sh", str(build / "build.sh")], capture_output=True, text=True, timeout=120)
    log = (build / "build.log").read_text()
    assert r.returncode == 3 and (build / "build.rc").read_text().strip() == "3"
    assert (f"pve-kernel at {head} builds {RELEASE} (its Makefile's KVNAME with KREL_EXTRA=-bpo12-pvegpu), "
            "but kernel.version says 6.14.8-2-pve") in log
    assert "submodule" not in log and "mk-build-deps" not in log


@pytest.mark.skipif(not shutil.which("dpkg-buildpackage"), reason="needs dpkg-dev")
def test_job_count_and_ccache_reach_debian_rules(pve_kernel, tmp_path):
    """pve-kernel's `make deb` runs `dpkg-buildpackage --jobs=auto`: that replaces parallel=N of
    DEB_BUILD_OPTIONS by the core count. The build script runs dpkg-buildpackage itself with
    --jobs=N, and ccache's gcc comes first on PATH; real debian/rules then gets -jN and that gcc."""
    upstream = subprocess.run(["make", "-n", "deb"], cwd=pve_kernel, capture_output=True, text=True).stdout
    assert "dpkg-buildpackage --jobs=auto -b -uc -us" in upstream  # the bypass this guards against
    subprocess.run(["make", "-s", "debian.prepared"], cwd=pve_kernel, check=True, capture_output=True)
    build_dir = pve_kernel / "proxmox-kernel-6.14.11"
    (tmp_path / "print.mk").write_text(PRINT_MK)
    text = script(RELEASE, jobs=3)
    assert not re.search(r"^[^#]*make deb\b", text, re.M) and "DEB_BUILD_OPTIONS=parallel" not in text
    found = re.search(r'\(cd "\$build_dir" && (dpkg-buildpackage [^)]*)\)', text)
    assert found, text
    call = found.group(1)
    assert call == "dpkg-buildpackage --jobs=3 -b -uc -us"
    assert text.index('export PATH="/usr/lib/ccache:$PATH"') < text.index(call)
    probe = f" -d -nc -T pvegpu-print --rules-file='make -f debian/rules -f {tmp_path}/print.mk'"
    env = {**os.environ, "DEB_BUILD_OPTIONS": "parallel=1", "PATH": "/usr/lib/ccache:" + os.environ["PATH"]}
    ours = subprocess.run(["sh", "-c", call + probe], cwd=build_dir, env=env, capture_output=True, text=True)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert re.search(r"^MAKEFLAGS=.*\s-j3\b", ours.stdout, re.M), ours.stdout
    assert "DEB_BUILD_OPTIONS=parallel=3" in ours.stdout
    if os.path.exists("/usr/lib/ccache/gcc"):
        assert "GCC=/usr/lib/ccache/gcc" in ours.stdout
    # the upstream recipe with the old environment knob: the core count wins
    theirs = subprocess.run(["sh", "-c", "dpkg-buildpackage --jobs=auto -b -uc -us" + probe], cwd=build_dir,
                            env={**env, "DEB_BUILD_OPTIONS": "parallel=3"}, capture_output=True, text=True)
    cores = subprocess.run(["getconf", "_NPROCESSORS_ONLN"], capture_output=True, text=True).stdout.strip()
    assert f"DEB_BUILD_OPTIONS=parallel={cores}" in theirs.stdout


def test_build_script_guards_the_build_conflict_with_installed_headers():
    text = script(RELEASE)
    assert "--no-remove" in text.split("mk-build-deps -ir", 1)[1].splitlines()[0]
    guard = text.index('dpkg-query -W -f=\'${Status}\' "proxmox-headers-$release"')
    assert guard < text.index("mk-build-deps")


def test_memory_ceiling_of_the_detached_build():
    gib = 1024 * 1024
    assert plan.build_memory_max_kib(512 * gib, 32) == 66 * gib  # 32 jobs x 2 GiB + 2 GiB
    assert plan.build_memory_max_kib(16 * gib, 8) == 14 * gib  # RAM less max(2 GiB, 1/8)
    assert plan.build_memory_max_kib(None, 4) is None
    cmd = kernel.start_build_command("/b", True, 66 * gib)
    assert "--property=MemoryMax=69206016K --property=MemorySwapMax=0" in cmd and "systemd-run" in cmd


def test_preflight_refuses_rebuilding_a_release_whose_headers_are_installed(monkeypatch):
    spec = HostSpec(kernel={"version": RELEASE, "source": {"kind": "proxmox-git", "url": "git://x/pve-kernel.git", "ref": REF}})
    facts = {"kernels": {"running": "6.14.8-2-pve", "installed": ["6.14.8-2-pve"], "pinned": None, "next_boot": None},
             "build": {**kernel_facts.parse_build_state(["headers-installed", "pbt", "esps", "uefi"])},
             "source": {"release": RELEASE, "from": "/var/lib/pvegpu/kernel-build/x/src"}}
    monkeypatch.setattr(kernel, "stage_facts", lambda k: facts)
    monkeypatch.setattr(kernel, "host", SimpleNamespace(name="kpro6"))
    refusals = kernel.preflight(spec)
    assert len(refusals) == 1 and f"proxmox-headers-{RELEASE} is installed" in refusals[0]
    facts["build"]["headers_installed"] = False
    assert kernel.preflight(spec) == []
    facts["source"]["release"] = "6.14.11-8-bpo12-pvegpu-pve"
    assert "builds 6.14.11-8-bpo12-pvegpu-pve" in kernel.preflight(spec)[0]


def test_build_script_checks_the_produced_deb_names(tmp_path):
    """The loop after dpkg-buildpackage, run for real: packages of another release fail the build."""
    text = script(RELEASE)
    loop = text[text.index("for pkg in proxmox-kernel proxmox-headers; do"):text.index("cp ./*.deb ..")]
    (tmp_path / "proxmox-kernel-6.14.11-9-pve_6.14.11-9_amd64.deb").write_text("")
    r = subprocess.run(["sh", "-c", f"release={RELEASE}\n{loop}"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 4
    assert f"produced ./proxmox-kernel-6.14.11-9-pve_6.14.11-9_amd64.deb but no proxmox-kernel-{RELEASE}_*.deb" in r.stderr
    for pkg in ("proxmox-kernel", "proxmox-headers"):
        (tmp_path / f"{pkg}-{RELEASE}_6.14.11-9~bpo12+1_amd64.deb").write_text("")
    r = subprocess.run(["sh", "-c", f"release={RELEASE}\n{loop}"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_preflight_refuses_a_finished_build_of_another_release(monkeypatch):
    k = KernelSpec(version=RELEASE, source={"kind": "proxmox-git", "url": "git://x/pve-kernel.git", "ref": REF})
    build = kernel_facts.parse_build_state(["rc 0", "deb proxmox-kernel-6.14.11-9-pve_6.14.11-9_amd64.deb"])
    build["manifest"] = {"build_id": plan.build_id(k, "running")}
    monkeypatch.setattr(kernel, "stage_facts", lambda _: {
        "kernels": {"running": "6.14.8-2-pve", "installed": ["6.14.8-2-pve"]}, "build": build, "source": None})
    monkeypatch.setattr(kernel, "host", SimpleNamespace(name="kpro6"))
    refusals = kernel.preflight(HostSpec(kernel=k.model_dump()))
    assert len(refusals) == 1 and "produced proxmox-kernel-6.14.11-9-pve_6.14.11-9_amd64.deb" in refusals[0]
