"""The real pve-kernel packaging of each tree scripts/fetch-upstream.sh provides (bookworm-6.14,
trixie-6.17, master/7.0), run as far as it goes without the Ubuntu kernel submodule: the tree's
own make computes the release, the package and .deb names and debian/control (its
debian.prepared target: debian/rules debian/control from control.in), with our KREL_EXTRA +
-pvegpu on the command line as templates/kernel-build.sh.j2 gives it; plan.kernel's release rule
must agree with all of it. Skips only when an archive cannot be fetched."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plan import kernel as plan
from spec.models import KernelSpec

REPO = Path(__file__).resolve().parents[2]
# name in scripts/upstream-sources.tsv -> (Proxmox's KVNAME, the tree's KREL_EXTRA, BUILD_DIR)
TREES = {
    "pve-kernel-bookworm-6.14": ("6.14.11-9-bpo12-pve", "-bpo12", "proxmox-kernel-6.14.11"),
    "pve-kernel-trixie-6.17": ("6.17.13-21-pve", "", "proxmox-kernel-6.17.13"),
    "pve-kernel-master-7.0": ("7.0.14-14-pve", "", "proxmox-kernel-7.0.14"),
}
pytestmark = pytest.mark.skipif(not shutil.which("dpkg-architecture"), reason="pve-kernel's Makefile needs dpkg-dev")


@pytest.fixture(scope="module", params=sorted(TREES))
def tree(request, tmp_path_factory) -> tuple[str, Path]:
    """The tree as a git repository (debian.prepared runs git rev-parse HEAD)."""
    name = request.param
    out = subprocess.run([str(REPO / "scripts/fetch-upstream.sh"), name], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip(f"{name} not available: {out.stderr[-300:]}")
    root = tmp_path_factory.mktemp(name) / "repo"
    root.mkdir()
    subprocess.run(["tar", "-xf", out.stdout.strip(), "-C", str(root), "--strip-components=1"], check=True)
    git = ["git", "-C", str(root), "-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", name], check=True)
    return name, root


def make_var(root: Path, name: str, *args: str) -> str:
    return subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", *args,
                           f"--eval=pvegpu-print: ; @echo $({name})", "pvegpu-print"],
                          cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_release_rule_agrees_with_the_trees_own_make(tree):
    name, root = tree
    upstream, krel_extra, build_dir = TREES[name]
    text = (root / "Makefile").read_text()
    ours = plan.built_release_from_makefile(text)
    assert plan.release_from_makefile(text) == make_var(root, "KVNAME") == upstream
    # the build script's command line: KREL_EXTRA = the tree's own + LOCAL_KREL_SUFFIX
    assert make_var(root, "KREL_EXTRA") == krel_extra
    mine = f"KREL_EXTRA={krel_extra}{plan.LOCAL_KREL_SUFFIX}"
    assert ours == make_var(root, "KVNAME", mine) and ours != upstream and plan.LOCAL_KREL_SUFFIX in ours
    assert make_var(root, "BUILD_DIR", mine) == build_dir
    # the .debs the tree's Makefile names are the ones the stage installs (plan.package_globs)
    debs = [make_var(root, "DST_DEB", mine), make_var(root, "HDR_DEB", mine)]
    assert plan.debs_of_release("proxmox-git", ours, debs), debs
    assert not plan.debs_of_release("proxmox-git", upstream, debs)


def test_debian_control_from_control_in_names_our_packages(tree, tmp_path):
    """`make debian.prepared` for real: debian/rules turns control.in into debian/control with
    our KVNAME; its Build-Depends are what the build script's dpkg-checkbuilddeps/mk-build-deps
    read, and the tools the stage installs first are what that step itself needs."""
    name, root = tree
    _, krel_extra, build_dir = TREES[name]
    work = tmp_path / "tree"
    shutil.copytree(root, work, symlinks=True)
    made = subprocess.run(["make", "-s", f"KREL_EXTRA={krel_extra}{plan.LOCAL_KREL_SUFFIX}", "debian.prepared"],
                          cwd=work, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    ours = plan.built_release_from_makefile((root / "Makefile").read_text())
    control = (work / build_dir / "debian/control").read_text()
    packages = re.findall(r"^Package: (\S+)$", control, re.M)
    assert f"proxmox-kernel-{ours}" in packages and f"proxmox-headers-{ours}" in packages
    assert not [p for p in packages if "@" in p]
    source = control.split("\n\n", 1)[0]
    assert f"Build-Conflicts: proxmox-headers-{ours}," in source  # the build script's headers guard
    build_depends = re.search(r"^Build-Depends:(.*?)^\S", source, re.M | re.S)
    assert build_depends, source
    names = {re.split(r"[\s(:]", d.strip())[0] for d in build_depends.group(1).split(",") if d.strip()}
    assert {"git", "gcc", "bc", "bison", "flex", "libelf-dev", "libssl-dev"} <= names
    # what the stage installs before the build, not left to mk-build-deps: mk-build-deps itself
    # (devscripts, equivs), and what the Makefile needs to get this far (make, dpkg-dev, git)
    k = KernelSpec(version=ours, source={"kind": "proxmox-git", "url": "git://x/pve-kernel.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"})
    assert {"devscripts", "equivs", "make", "dpkg-dev", "git", "build-essential"} <= set(plan.build_tools(k))
    assert f"KVNAME={ours}" in (work / build_dir / "debian/rules.d/env.mk").read_text()


def test_every_tree_is_listed_for_fetch_upstream():
    table = (REPO / "scripts/upstream-sources.tsv").read_text()
    for name in TREES:
        row = [line for line in table.splitlines() if line.startswith(name + "\t")]
        assert len(row) == 1 and all(re.fullmatch(r"[0-9a-f]{64}", s) for s in row[0].split("\t")[2:4]), name
    assert fnmatch.fnmatch("proxmox-kernel-7.0.14-14-pvegpu-pve_7.0.14-14_amd64.deb",
                           plan.package_globs("proxmox-git", "7.0.14-14-pvegpu-pve")[0])
