"""Issue 42: the shipped example inventories pass the rules a real host would apply to them.

Every inventories/*.yml loads as pyinfra loads it (spec.load), and every proxmox-git kernel it
names passes the release rule (plan.kernel.release_refusal) against the pinned pve-kernel tree
itself: the tree of that commit (scripts/upstream-sources.tsv, fetched by
scripts/fetch-upstream.sh), its Makefile read by facts.kernel.built_release_from_makefile as the
kernel stage reads the clone on the host. The `--dry` of each example on its twin profile is
tests/e2e/test_example_inventories_e2e.py's.
"""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

from facts.kernel import built_release_from_makefile
from plan.kernel import release_refusal
from spec.load import SpecError, load_spec_file, validate_spec

REPO = Path(__file__).resolve().parents[2]
# the shipped examples (git-tracked): a site's own inventories/<site>.yml is not held to the tree list
EXAMPLES = sorted(REPO / p for p in subprocess.run(["git", "ls-files", "inventories/*.yml"], cwd=REPO,
                                                   capture_output=True, text=True, check=True).stdout.split())


def pinned_tree(ref: str) -> str:
    """The name of the upstream-sources.tsv row that is pve-kernel at commit `ref`."""
    for line in (REPO / "scripts/upstream-sources.tsv").read_text().splitlines():
        if line.startswith("pve-kernel-") and f"h={ref};" in line:
            return line.split("\t", 1)[0]
    raise AssertionError(f"pve-kernel at {ref} is not in scripts/upstream-sources.tsv; add its archive there")


def makefile_of(name: str) -> str:
    out = subprocess.run([str(REPO / "scripts/fetch-upstream.sh"), name], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip(f"{name} not available: {out.stderr[-300:]}")
    with tarfile.open(out.stdout.strip()) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/Makefile"))
        data = tar.extractfile(member)
        assert data is not None
        return data.read().decode()


def test_every_example_is_listed():
    assert {p.name for p in EXAMPLES} >= {"kpro6.yml", "kpro6-pve9.yml", "h200-vm.yml", "twin.yml"}
    for yml in EXAMPLES:
        assert yml.with_suffix(".py").exists(), f"{yml.name} has no inventory file beside it"


@pytest.mark.parametrize("yml", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_loads(yml):
    assert load_spec_file(yml)


KERNELS = [(yml, name) for yml in EXAMPLES for name, spec in load_spec_file(yml).items()
           if spec.kernel is not None and spec.kernel.source.kind == "proxmox-git"]


def test_the_real_examples_pin_a_kernel():
    assert {(y.name, h) for y, h in KERNELS} >= {("kpro6.yml", "kpro6"), ("kpro6-pve9.yml", "kpro6")}


@pytest.mark.parametrize("yml,host", KERNELS, ids=[f"{y.stem}-{h}" for y, h in KERNELS])
def test_example_kernel_passes_the_release_rule_against_its_pinned_tree(yml, host):
    kernel = load_spec_file(yml)[host].kernel
    assert kernel is not None and kernel.source.ref
    built = built_release_from_makefile(makefile_of(pinned_tree(kernel.source.ref)))
    assert release_refusal(kernel, built, "the pinned tree") is None, f"{yml.name} {host}: kernel.version " \
        f"{kernel.version}, but our build of {kernel.source.ref} produces {built}"


def test_the_pve9_refusal_names_releases_the_trees_build():
    """A -bpo12 kernel with proxmox_ve 9 is refused naming a trixie release to write instead; each
    named release is what our build of that tree produces (not Proxmox's own name of it)."""
    base = load_spec_file(REPO / "inventories/kpro6-pve9.yml")["kpro6"].model_dump(mode="json", exclude_none=True)
    base["kernel"]["version"] = "6.14.11-9-bpo12-pvegpu-pve"
    with pytest.raises(SpecError) as err:
        validate_spec({"hosts": {"kpro6": base}}, Path("x.yml"))
    message = str(err.value)
    for tree in ("pve-kernel-master-7.0", "pve-kernel-trixie-6.17"):
        built = built_release_from_makefile(makefile_of(tree))
        assert built and f": {built}" in message, (tree, built, message)


def test_the_pve8_refusal_names_the_release_its_tree_builds():
    """Issue 40: proxmox_ve: 8 refuses a 9 kernel naming a bookworm release to write instead; that
    release is what our build of the bookworm-6.14 tree produces, and the one kpro6.yml ships."""
    base = load_spec_file(REPO / "inventories/kpro6.yml")["kpro6"].model_dump(mode="json", exclude_none=True)
    shipped = base["kernel"]["version"]
    base.update(proxmox_ve=8, kernel={**base["kernel"], "version": "7.0.14-14-pvegpu-pve"})
    with pytest.raises(SpecError) as err:
        validate_spec({"hosts": {"kpro6": base}}, Path("x.yml"))
    built = built_release_from_makefile(makefile_of("pve-kernel-bookworm-6.14"))
    assert built == shipped and f": {built}" in str(err.value), (built, shipped, str(err.value))
