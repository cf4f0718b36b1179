"""The kernel release and package rules against pve-kernel's trixie branches (Proxmox VE 9; issue
29 part 2): trixie-6.17 at 74c6afb and master at 6e44995 (the 9.2 series), through
scripts/fetch-upstream.sh. Their Makefiles leave KREL_EXTRA empty (no -bpo suffix): the releases
are 6.17.13-21-pve and 7.0.14-14-pve, ours add -pvegpu, the headers package is
proxmox-headers-<KVNAME> (debian/rules PMX_HEADER_PKG), as on bookworm."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plan import kernel as plan

REPO = Path(__file__).resolve().parents[2]
TREES = {"pve-kernel-trixie-6.17": ("6.17.13-21-pve", "6.17.13-21-pvegpu-pve", "proxmox-kernel-6.17.13"),
         "pve-kernel-master-7.0": ("7.0.14-14-pve", "7.0.14-14-pvegpu-pve", "proxmox-kernel-7.0.14")}


@pytest.fixture(scope="module", params=sorted(TREES))
def tree(request, tmp_path_factory) -> tuple[str, Path]:
    out = subprocess.run([str(REPO / "scripts/fetch-upstream.sh"), request.param],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip(f"{request.param} not available: {out.stderr[-300:]}")
    root = tmp_path_factory.mktemp(request.param)
    # the top-level build files are enough (the trees' submodules are not in the archives)
    subprocess.run(["tar", "-xf", out.stdout.strip(), "-C", str(root), "--strip-components=1", "--wildcards",
                    "*/Makefile", "*/debian/*"], check=True)
    return request.param, root


def test_trixie_branches_build_releases_without_bpo(tree):
    name, root = tree
    upstream, ours, build_dir = TREES[name]
    text = (root / "Makefile").read_text()
    assert plan.release_from_makefile(text) == upstream
    assert plan.built_release_from_makefile(text) == ours
    variables = plan.makefile_variables(text)
    assert (variables["KREL_EXTRA"], variables["BUILD_DIR"]) == ("", build_dir)
    # the same values real make gives, with and without our KREL_EXTRA
    for args, want in (([], upstream), (["KREL_EXTRA=-pvegpu"], ours)):
        made = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", *args,
                               "--eval=pvegpu-kvname: ; @echo $(KVNAME)", "pvegpu-kvname"],
                              cwd=root, capture_output=True, text=True, check=True)
        assert made.stdout.strip() == want


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_headers_package_name_follows_debian_rules(tree):
    name, root = tree
    upstream, ours, _ = TREES[name]
    rules = (root / "debian/rules").read_text()
    assert re.search(r"^PMX_HEADER_PKG=proxmox-headers-\$\(KVNAME\)$", rules, re.M)
    assert plan.package_globs("proxmox-git", ours) == [f"proxmox-kernel-{ours}_*.deb", f"proxmox-headers-{ours}_*.deb"]
