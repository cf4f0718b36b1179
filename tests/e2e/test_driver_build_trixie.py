"""NVIDIA open 595.45.04 on trixie with GCC 14, for real (issue 29 part 3): which driver x kernel
pairs build, and the refusal of the one that does not.

The twin is kpro6 on Proxmox VE 9 (tests/twin/profiles/kpro6-pve9.yml) booting Debian trixie's own
6.12 (linux-headers-amd64 of trixie: real headers built by gcc-14, installed by apt in the trixie root),
the Debian kernel standing in for 9's Proxmox kernels, whose headers the twin does not have. The
archive is open-gpu-kernel-modules 595.45.04 (`scripts/fetch-upstream.sh`, as test_driver_build.py).

1. The NVIDIA stage (with the kernel hook stage, `kernel_updates: follow`) builds the real tree for
   the running 6.12 with gcc-14 and g++-14: src/ (C and C++) once, then kernel-open/ with real kbuild;
   five modules of the version, the release's vermagic, every one compiled by GCC 14.2.0 (the
   .comment section); ccache fills.
2. apt brings a 7.x kernel: the proxmox-kernel .deb of trixie-backports' 7.x release (its real
   headers, Debian's split -common/-amd64 trees, are unpacked in the trixie twin root), whose
   postinst runs /etc/kernel/postinst.d as pve-kernel's does. pvegpu's hook (the driver x kernel
   gate of kernels apt installs) builds 595.45.04 for it through the stage's build script: src/ comes
   from ccache (the GCC 14 objects of step 1 reused, not compiled again: over 1000 hits, misses under
   a fifth of them, though apt runs here in an ssh session that sent LANG and the converge had none:
   the build script fixes the locale ccache hashes; before it, all ~1270 src/ compiles missed and
   took as long as step 1's), kernel-open/ fails on
   `#include <linux/of_gpio.h>` (kernel-open/common/inc/nv-linux.h:1730; the 7.x kernels no longer
   have that header). The refusal quotes that first error; the 6.12 kernel stays the boot default
   (pinned), its modules stay byte-for-byte, the 7.x kernel gets no modules, dpkg is clean; the next
   --dry says the same and changes nothing.

Pairs on trixie (GCC 14): 595.45.04 x 6.12 builds; 595.45.04 x 7.x does not (of_gpio.h).

This is also where CI proves, for test_driver_build.py (which builds one release), that src/ is
built once for a later kernel's modules from ccache (a rebuild answered by the cache), and that
595.45.04's kernel-open/ builds against a 6.12 kernel with real kbuild.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.e2e import test_kernel_upgrade_e2e as ku
from tests.e2e.harness import REPO, manifest_diff, root_manifest, run_pyinfra, spec_inventory
from tests.e2e.test_driver_build import ccache_counters, ccache_hits
from tests.twin import kernel_packages as kp
from tests.twin import runtime

pytestmark = [pytest.mark.twin, pytest.mark.slow]

NAME = "s11t-trixie"
SOURCE = "open-gpu-kernel-modules-595.45.04"
VERSION = "595.45.04"
ARCHIVE = f"/opt/src/{SOURCE}.tar.xz"
MODULES = ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem")
STAGES = {"PVEGPU_STAGES": "operations.nvidia,operations.kernel_hook"}
STAGE_DEPLOY = str(REPO / "tests/e2e/stage_deploy.py")
CCACHE_STATS = "CCACHE_DIR=/var/cache/pvegpu/ccache ccache --print-stats"
ESP_LOADER = "var/lib/twin/esp/5A1C-9E27/loader/loader.conf"  # kpro6's ESP (systemd-boot)
# gcc -E of NVIDIA's nv-linux.h against a 7.x kernel: the include line of of_gpio.h, as first_error
# (templates/nvidia-first-error.sh.j2) cuts it (the path up to kernel-open/ dropped)
OF_GPIO = "kernel-open/common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file or directory"


def trixie_releases(root: Path) -> tuple[str, str]:
    """(trixie's 6.12, trixie-backports' 7.x): the releases whose headers the trixie root has."""
    releases = sorted((p.name for p in (root / "lib/modules").iterdir()
                       if (root / f"usr/src/linux-headers-{p.name}/Makefile").exists()),
                      key=lambda r: [int(x) for x in r.split("+")[0].split("-")[0].split(".")])
    assert len(releases) == 2 and releases[0].startswith("6.12.") and releases[1].startswith("7."), \
        f"the trixie root should have Debian's 6.12 and a trixie-backports 7.x headers, has {releases}"
    return releases[0], releases[1]


def write_inventory(tmp: Path, twin, sha: str) -> str:
    nvidia = {"version": VERSION, "open": True, "modules_source": {"url": f"file://{ARCHIVE}", "sha256": sha},
              "firmware": False, "persistenced": False}
    return spec_inventory(tmp, twin, {"node": "kpro6", "proxmox_ve": 9, "kernel_updates": "follow", "nvidia": nvidia},
                          "trixie")


def publish(twin, tmp: Path, new: str | None) -> None:
    """A local apt repository in the twin (file:/opt/repo, nothing leaves it), the way Proxmox's metas
    chain: proxmox-default-kernel -> proxmox-kernel-X.Y -> the release (and the same for headers).
    new None: the metas only (the running 6.12 is Debian's own linux-image package of the root);
    else version 2 of the metas naming `new`'s kernel package (test_kernel_upgrade_e2e's .debs)."""
    root = Path(twin.root)
    out = tmp / f"debs-{new or 'base'}"
    out.mkdir()
    if new is None:
        debs = kp.default_metas(out, None, "1")
    else:  # pve-kernel's shapes (tests/twin/kernel_packages.py); the headers' files are already in the
        # twin root (unpacked from Debian's packages), their build link too
        series = ".".join(new.split(".")[:2])
        files = {f"boot/vmlinuz-{new}": "twin stand-in kernel image\n",
                 f"boot/config-{new}": (root / f"usr/src/linux-headers-{new}/.config").read_text(),
                 f"boot/System.map-{new}": "", f"lib/modules/{new}/modules.order": "",
                 f"lib/modules/{new}/modules.builtin": ""}
        debs = [kp.pve_firmware(out), *kp.release_chain(out, new, series, "1", "2", files,
                                                        headers_kwargs={"build_link": False})]
    repo = root / "opt/repo"
    subprocess.run(["rm", "-rf", str(repo)], check=True)
    repo.mkdir(parents=True)
    for path in debs:
        (repo / path.name).write_bytes(path.read_bytes())
    ku.twin_sh(twin, "mkdir -p /root/apt-sources && mv /etc/apt/sources.list /etc/apt/sources.list.d/* /root/apt-sources/ "
                     "2>/dev/null; echo 'deb [trusted=yes] file:/opt/repo ./' > /etc/apt/sources.list.d/pvegpu-e2e.list; "
                     "cd /opt/repo && dpkg-scanpackages -m . > Packages 2>/dev/null && apt-get -q update")
    # apt runs dpkg with DPkg::Path (apt-pkg/deb/dpkgpm.cc); the twin's proxmox-boot-tool is in /usr/local/sbin
    (root / "etc/apt/apt.conf.d/99pvegpu-twin-standins").write_text(
        'DPkg::Path "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";\n')


def modules_state(twin, release: str) -> str:
    """Checksums of a release's installed modules and depmod's index: any install or depmod changes it."""
    return ku.twin_sh(twin, f"cd /lib/modules/{release} && find updates -type f -exec sha256sum {{}} + | sort; "
                            "sha256sum modules.dep modules.dep.bin")


@pytest.fixture
def trixie_twin(twin_factory, tmp_path):
    old, new = trixie_releases(runtime.ensure_root_cache("trixie"))
    fetched = subprocess.run(["bash", str(REPO / "scripts/fetch-upstream.sh"), SOURCE], capture_output=True, text=True)
    assert fetched.returncode == 0, fetched.stderr
    archive = Path(fetched.stdout.strip().splitlines()[-1])
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    # kpro6 on 9, booting trixie's 6.12 (its image is the root's linux-image package)
    profile = tmp_path / "kpro6-pve9-612.yml"
    profile.write_text(f"extends: kpro6-pve9\nname: s11t-kpro6-9\n"
                       f"kernel: {{release: {old}, version: '#1 SMP PREEMPT_DYNAMIC Debian {old.split('+')[0]}-1', "
                       f"installed: [{old}]}}\n")
    twin = twin_factory(str(profile), name=NAME)
    root = Path(twin.root)
    assert ku.twin_sh(twin, "uname -r").strip() == old
    (root / "opt/src").mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", str(archive), str(root / ARCHIVE.lstrip("/"))], check=True)
    # the profile seeds its own driver's NVML library; this host has no NVIDIA user space yet
    ku.twin_sh(twin, "rm -f /usr/lib/x86_64-linux-gnu/libnvidia-ml.so*")
    publish(twin, tmp_path, None)
    ku.twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q install -y proxmox-default-kernel")
    return twin, old, new, write_inventory(tmp_path, twin, sha)


def test_595_builds_for_trixie_6_12_and_is_refused_for_7_x(trixie_twin, tmp_path):
    twin, old, new = trixie_twin[:3]
    inventory = trixie_twin[3]
    root = Path(twin.root)

    # 1. the real build for trixie's 6.12 with GCC 14 (src/ ~4 min alone on two cores; an hour for a shared machine)
    run = run_pyinfra(inventory, STAGE_DEPLOY, env=STAGES, timeout=3600)
    assert run.rc == 0, run.output[-5000:]
    builds = ku.twin_sh(twin, "cat /var/cache/pvegpu/nvidia-build/builds.log").splitlines()  # the build's own notes
    assert builds[0] == (f"pvegpu: building nvidia {VERSION} src/ (nv-kernel.o, nv-modeset-kernel.o) "
                         "with gcc-14 and g++-14"), builds
    assert builds[1].startswith(f"pvegpu: building nvidia {VERSION} for {old} in ") and " with gcc-14 " in builds[1], builds
    assert len(builds) == 2, builds
    for module in MODULES:
        info = ku.twin_sh(twin, f"modinfo -k {old} -F version {module}; modinfo -k {old} -F vermagic {module}; "
                                f"modinfo -k {old} -F filename {module}").splitlines()
        assert info[0] == VERSION and info[1].split()[0] == old, (module, info)
        assert info[2].startswith(f"/lib/modules/{old}/updates/pvegpu-nvidia/"), (module, info)
        # every object of the module (src/'s C and C++ ones too) was compiled by trixie's GCC 14.2.0
        comment = ku.twin_sh(twin, f"readelf -p .comment {info[2]}")
        compilers = {line.split("]", 1)[1].strip() for line in comment.splitlines() if line.strip().startswith("[")}
        assert compilers and all(c.startswith("GCC: (Debian 14.2.0-") and c.endswith(") 14.2.0") for c in compilers), \
            (module, compilers)
    assert ku.twin_sh(twin, "test -x /etc/kernel/postinst.d/00pvegpu-nvidia && echo yes").strip() == "yes"
    assert "gcc-14" in ku.twin_sh(twin, "cat /etc/kernel/postinst.d/00pvegpu-nvidia")
    modules_before = modules_state(twin, old)
    stats_before = ku.twin_sh(twin, CCACHE_STATS)

    # 2. apt brings trixie-backports' 7.x: the hook refuses it with the compiler's first error
    publish(twin, tmp_path, new)
    upgrade = ku.twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q full-upgrade -y 2>&1", timeout=3600)
    assert f"proxmox-kernel-{new}" in upgrade, upgrade[-3000:]
    reason = f"nvidia {VERSION} could not be built for kernel {new}: the build failed (exit 1): {OF_GPIO}"
    assert f"pvegpu: {reason}" in upgrade, upgrade[-5000:]
    assert f"pvegpu: {old} stays the boot default (pinned by pvegpu" in upgrade, upgrade[-3000:]
    assert ku.twin_sh(twin, "dpkg --audit").strip() == ""  # the kernel package is configured
    assert ku.twin_sh(twin, f"dpkg-query -W -f '${{Status}}' proxmox-kernel-{new}-signed") == "install ok installed"
    hook_log = ku.twin_sh(twin, f"cat /var/lib/pvegpu/kernel-hook/{new}.log")
    # src/ was not compiled again: GCC 14's objects of step 1 came from ccache (~1270 src/ compiles; the
    # misses are 7.x's own kernel-open/ compiles before the failing one)
    assert f"pvegpu: building nvidia {VERSION} src/ (nv-kernel.o, nv-modeset-kernel.o) with gcc-14 and g++-14" in hook_log
    stats_after = ku.twin_sh(twin, CCACHE_STATS)
    hits = ccache_hits(stats_after) - ccache_hits(stats_before)
    misses = ccache_counters(stats_after)["cache_miss"] - ccache_counters(stats_before)["cache_miss"]
    print(f"kernel hook's build for {new}: ccache {hits} hits, {misses} misses")
    assert hits > 1000 and misses * 5 < hits, (hits, misses, hook_log[-3000:])
    # nothing changed for the kernels: no modules for 7.x, 6.12's untouched and still the default
    assert ku.nvidia_version(twin, new) == ""
    assert ku.twin_sh(twin, f"ls /lib/modules/{new}/updates 2>/dev/null || true").strip() == ""
    assert modules_state(twin, old) == modules_before
    assert ku.twin_sh(twin, "head -n1 /etc/kernel/proxmox-boot-pin").strip() == old
    assert f"default proxmox-{old}.conf" in (root / ESP_LOADER).read_text()
    failed = ku.twin_sh(twin, f"cat /var/lib/pvegpu/kernel-hook/{new}.failed")
    assert reason in failed and f"{old} stays the boot default" in failed, failed
    assert OF_GPIO in ku.twin_sh(twin, "cat /etc/motd.d/pvegpu-kernel")

    # 3. the next --dry says the same and changes nothing
    before = root_manifest(twin.root)
    dry = run_pyinfra(inventory, STAGE_DEPLOY, "--dry", env=STAGES, timeout=900)
    assert dry.rc == 0, dry.output[-4000:]
    assert manifest_diff(before, root_manifest(twin.root)) == [], "--dry changed the twin"
    assert f"kernel {new}: {reason}" in dry.output, dry.output[-4000:]
