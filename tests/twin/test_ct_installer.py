"""The twin's NVIDIA installer (.run) on this machine: pinned bytes, extraction, flags.

Installing runs only inside a twin container (tests/twin/test_ct.py): it writes to /usr.
"""
import hashlib
import subprocess

import pytest

from tests.twin import hardware, installer

# inventories/twin.yml pins these (nvidia.installer sha256): a change of the payload or the script
# must show up here first. Versions: the profiles' drivers.
PINNED = {
    "595.71.05": "ffa796d905a8d99d1af8e97d2270a5cbe1a4ce34b9cd8499811d862f3c0d234a",  # kpro6
    "570.172.08": "4064a49f9d91f72ab7d63d01adec1680669aaa328828e1dfaacdd02f8fa00e3a",  # intel2
    "580.159.04": "173fc802b83d79b099ab86c3fe91936d9667ff052c5d094b8b900d256e005231",  # h200-vm
}


@pytest.mark.parametrize("profile", ["kpro6", "intel2", "h200-vm"])
def test_installer_bytes_are_pinned_per_profile_version(tmp_path, profile):
    version = hardware.load_profile(profile)["nvidia"]["version"]
    path = installer.build(version, tmp_path)
    assert path.name == f"NVIDIA-Linux-x86_64-{version}.run"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == PINNED[version]


def test_build_is_byte_identical_every_time(tmp_path):
    a = installer.build("595.71.05", tmp_path / "a").read_bytes()
    b = installer.build("595.71.05", tmp_path / "b").read_bytes()
    assert a == b and a != installer.build("570.172.08", tmp_path / "c").read_bytes()


def test_hardware_install_places_the_profiles_installer(tmp_path):
    root = tmp_path / "root"
    hardware.install(root, "intel2")
    placed = root / "opt/nvidia/NVIDIA-Linux-x86_64-570.172.08.run"
    assert placed.read_bytes() == installer.build("570.172.08", tmp_path).read_bytes()


def run(path, *args, cwd=None):
    return subprocess.run(["sh", str(path), *args], capture_output=True, text=True, cwd=cwd, timeout=30)


def test_extract_only_gives_the_tree_firmware_command_reads(tmp_path):
    path = installer.build("595.71.05", tmp_path)
    r = run(path, "--extract-only", "--target", str(tmp_path / "x/y"))
    assert r.returncode == 0, r.stderr
    files = sorted(str(p.relative_to(tmp_path / "x/y")) for p in (tmp_path / "x/y").rglob("*") if p.is_file())
    assert files == ["firmware/gsp_ga10x.bin", "firmware/gsp_tu10x.bin", "libcuda.so.595.71.05",
                     "libnvidia-ml.so.595.71.05", "nvidia-smi"]
    assert (tmp_path / "x/y/firmware/gsp_ga10x.bin").read_text() == "twin placeholder: GSP firmware ga10x 595.71.05\n"
    assert run(path, "-x", cwd=tmp_path).returncode == 0  # default target: ./NVIDIA-Linux-x86_64-<v>
    assert (tmp_path / "NVIDIA-Linux-x86_64-595.71.05/nvidia-smi").stat().st_mode & 0o777 == 0o755


def test_flags_version_unknown_and_kernel_modules_refused_before_writing(tmp_path):
    path = installer.build("570.172.08", tmp_path)
    r = run(path, "--version")
    assert r.returncode == 0 and r.stdout.splitlines()[:2] == ["", "nvidia-installer:  version 570.172.08"]
    r = run(path, "--silent", "--frobnicate")
    assert r.returncode == 1 and r.stderr == 'ERROR: Unrecognized option: "--frobnicate"\n'
    # --no-kernel-module-source is not --no-kernel-modules: still refused, and nothing written
    r = run(path, "--silent", "--accept-license", "--no-kernel-module-source", "--no-dkms")
    assert r.returncode == 1 and "cannot build kernel modules; run it with --no-kernel-modules" in r.stderr
