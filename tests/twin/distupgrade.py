"""A real Proxmox VE 8 -> 9 distribution upgrade of a bookworm twin (issue 40 item 4).

Debian's packages come from Debian's archive (the mirror the twin roots are debootstrapped from,
tests/twin/runtime.py debian_mirrors); Proxmox's are modelled in a local apt repository inside the
twin (/opt/pve-repo, a `file:` repository with dists/<suite>/pve-no-subscription, as
download.proxmox.com lays it out), with their real names and versions and the relations that decide
dpkg's order:

- proxmox-ve 8.4.0 / 9.1.0 Depends proxmox-default-kernel, proxmox-kernel-helper, pve-manager
  (proxmox-ve's source is not to be had here: these three are the relations pve8to9.pm and the
  upgrade guide rely on; the rest of its list is Proxmox's own libraries, not modelled).
- pve-manager 8.4.1 / 9.2.11 (pve-manager debian/changelog of stable-8 / master): of its Depends
  (debian/control) those Debian has (apt, ca-certificates, gdisk, pciutils, perl, rsync, systemd,
  zstd); Proxmox's libraries are left out. Its files: none, like the twin's bookworm stanza; the
  twin's stand-in CLIs (pveversion, pct, qm, pvesh) stay under /usr/local (tests/twin/hardware.py
  install_standins), which no package touches. Its postinst: debian/postinst's configure step that
  can run in a twin (systemd-tmpfiles --create pve-manager.conf || true).
- the kernel chain of pve-kernel (tests/twin/kernel_packages.py, debian/control.in and
  proxmox-kernel.postinst.in: the image's postinst runs /etc/kernel/postinst.d with run-parts
  --exit-on-error, so pvegpu's hook runs inside the transaction): proxmox-default-kernel and
  -headers 1.1.0 (bookworm) / 2.0.0 (trixie) -> proxmox-kernel-X.Y -> proxmox-kernel-<rel>-signed,
  proxmox-headers-X.Y -> proxmox-headers-<rel>.
- proxmox-kernel-helper 9.2.0 built from its real source (the recipe of the twin's boot layer,
  runtime._build_boot_layer) and 8.1.4 as the bookworm root has it installed.

9's kernel: Debian trixie's own release, the one trixie's linux-headers-amd64 names (the twin has
no Proxmox 9 kernel's headers; the same stand-in as tests/e2e/test_pve_upgrade_e2e.py and
test_driver_build_trixie.py): proxmox-kernel-<rel>-signed carries its image stand-in and the real
config; proxmox-headers-<rel> Depends on Debian's real linux-headers-<rel> (built by gcc-14, and
depending on gcc-14: apt configures the compiler before the headers) instead of carrying the tree.
8's kernel is the profile's 6.8.12-11-pve (its image package a dpkg stanza of the twin).

Cache (`.cache/distup/<key>/`, key: the bookworm root's cache key, the mirror, the target suite):
`lists/` the Debian indexes of the first `apt-get update` (reruns use them and do not update: the
package set is fixed, and a rerun needs no network when the .debs are there), `archives/` every
.deb apt downloaded, and the proxmox-kernel-helper 9.2.0 .deb.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

from tests.twin import kernel_packages as kp
from tests.twin import runtime

CACHE_FORMAT = 1
CACHE = runtime.REPO / ".cache" / "distup"
REPO_DIR = "opt/pve-repo"
COMPONENT = "pve-no-subscription"
# the one-line file the guide's no-subscription repository has on 8 (the host's format is kept by
# the move to trixie: a sed of the suite, as Proxmox's upgrade guide does it)
PVE_LIST = "etc/apt/sources.list.d/pve-install-repo.list"
PVE = {
    "bookworm": {"proxmox-ve": "8.4.0", "pve-manager": "8.4.1", "meta": "1.1.0"},
    "trixie": {"proxmox-ve": "9.1.0", "pve-manager": "9.2.11", "meta": "2.0.0"},
}
# pve-manager debian/control Depends that Debian has
PVE_MANAGER_DEPENDS = "apt (>= 1.5~), ca-certificates, gdisk, pciutils, perl (>= 5.10.0-19), rsync, systemd, zstd"
HELPER_9 = runtime.KERNEL_HELPER["trixie"]
APT_ENV = "DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8"
# the upgrade guide's answers, unattended: keep the admin's conffiles unless the package default is asked
DPKG_OPTS = "-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"


def cache_dir(source: str = "bookworm", target: str = "trixie") -> Path:
    key = hashlib.sha256(json.dumps({"root": runtime.cache_key(source), "mirrors": runtime.debian_mirrors(),
                                     "target": target, "format": CACHE_FORMAT}, sort_keys=True).encode()).hexdigest()[:16]
    return CACHE / f"{source}-{target}-{key}"


def sh(twin, command: str, check: bool = True, timeout: int = 1200) -> subprocess.CompletedProcess:
    """`command` in the twin over its ssh (retried while sshd restarts)."""
    done = runtime.ssh_run(twin.name, [command], timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"in twin: {command}: exit {done.returncode}\n{done.stdout[-6000:]}{done.stderr[-3000:]}")
    return done


def helper_deb(twin) -> Path:
    """proxmox-kernel-helper 9.2.0's .deb, built in the twin from its source as its Makefile does
    (runtime._build_boot_layer's recipe), cached by the source's sha256."""
    sha = runtime.upstream_sha256(HELPER_9)
    cached = CACHE / f"{HELPER_9}-{sha[:16]}.deb"
    if cached.exists():
        return cached
    archive = subprocess.run([str(runtime.REPO / "scripts/fetch-upstream.sh"), HELPER_9], check=True,
                             stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    root = Path(twin.root)
    shutil.copyfile(archive, root / "tmp/pvegpu-kh.tar.xz")
    sh(twin, "set -e; rm -rf /tmp/pvegpu-kh && mkdir /tmp/pvegpu-kh && tar -C /tmp/pvegpu-kh -xJf /tmp/pvegpu-kh.tar.xz; "
             f"cd /tmp/pvegpu-kh/{HELPER_9} && cp -a src build && cp -a debian build/ && cd build && "
             "dpkg-buildpackage -b -uc -us -d >/tmp/pvegpu-kh/build.log 2>&1 || { tail -n 40 /tmp/pvegpu-kh/build.log; exit 1; }")
    built = list((root / "tmp/pvegpu-kh" / HELPER_9).glob("proxmox-kernel-helper_*_all.deb"))
    assert len(built) == 1, built
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(built[0], cached.with_suffix(".part"))
    cached.with_suffix(".part").rename(cached)
    sh(twin, "rm -rf /tmp/pvegpu-kh /tmp/pvegpu-kh.tar.xz")
    return cached


def pve_debs(out: Path, suite: str, kernel: str, kernel_version: str, image_files: dict | None,
             headers_depends: str = "") -> list[Path]:
    """Proxmox's packages of `suite` (see the module's docstring) for kernel release `kernel`
    (image_files None: no image package, the twin's dpkg stanza of it stands)."""
    v = PVE[suite]
    series = ".".join(kernel.split(".")[:2])
    out.mkdir(parents=True, exist_ok=True)
    pve_manager = kp._package(
        out, "pve-manager", v["pve-manager"], "all", "Proxmox Virtual Environment Management Tools",
        scripts={"postinst": "#!/bin/sh\n# twin: pve-manager debian/postinst (its configure step a twin can run)\n"
                             'if [ "$1" = configure ] && command -v systemd-tmpfiles >/dev/null 2>&1; then\n'
                             "  systemd-tmpfiles --create pve-manager.conf || true\nfi\nexit 0\n"},
        Depends=PVE_MANAGER_DEPENDS, Conflicts="vlan, vzdump", Replaces="vlan, vzdump", Provides="vlan, vzdump")
    proxmox_ve = kp._package(
        out, "proxmox-ve", v["proxmox-ve"], "all", "Proxmox Virtual Environment",
        Depends=f"proxmox-default-kernel, proxmox-kernel-helper, pve-manager (>= {v['pve-manager'].split('.')[0]}.0.0~)")
    debs = [pve_manager, proxmox_ve, kp.pve_firmware(out),
            kp.headers(out, kernel, kernel_version, build_link=False, depends=headers_depends),
            *kp.series_metas(out, series, kernel, kernel_version), *kp.default_metas(out, series, v["meta"])]
    if image_files is not None:
        debs.append(image(out, kernel, kernel_version, image_files))
    return debs


def image(out: Path, release: str, version: str, files: dict) -> Path:
    """proxmox-kernel-<rel>-signed as kernel_packages.image makes it (pve-kernel's relations and
    maintainer scripts), plus, for the Debian release standing in for 9's kernel: Provides
    `linux-image-<rel> (= version)`, Conflicts and Replaces `linux-image-<rel>`. Debian's
    linux-headers-<rel> (which the twin root's linux-headers-amd64 pulls) Depends on that image
    at its version; without this apt installs Debian's image too and dpkg refuses the second
    owner of /boot/System.map-<rel> (Proxmox's headers depend on no image)."""
    unsigned = f"proxmox-kernel-{release}"
    debian = f"linux-image-{release}"
    return kp._package(out, f"{unsigned}-signed", version, "amd64", "Proxmox Kernel Image (signed)", files,
                       scripts=kp.image_scripts(release), Depends=kp.IMAGE_DEPENDS,
                       Provides=f"linux-image-{release}-amd64, {unsigned}, {debian} (= {version})",
                       Conflicts=f"{unsigned}, {debian}", Replaces=f"{unsigned}, {debian}")


def publish(twin, debs: list[Path], suite: str) -> None:
    """`debs` as dists/<suite>/pve-no-subscription of the twin's /opt/pve-repo (Packages by
    dpkg-scanpackages, a Release with their checksums: apt verifies them even for trusted=yes)."""
    root = Path(twin.root)
    pool = root / REPO_DIR / "pool" / suite
    pool.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        shutil.copyfile(deb, pool / deb.name)
    rel = f"dists/{suite}/{COMPONENT}/binary-amd64"
    sh(twin, f"cd /{REPO_DIR} && mkdir -p {rel} && dpkg-scanpackages -m pool/{suite} > {rel}/Packages 2>/dev/null")
    index = (root / REPO_DIR / rel / "Packages").read_bytes()
    release = (f"Origin: Proxmox\nLabel: Proxmox Debian Repository (pvegpu twin)\nSuite: {suite}\nCodename: {suite}\n"
               f"Architectures: amd64\nComponents: {COMPONENT}\nSHA256:\n"
               f" {hashlib.sha256(index).hexdigest()} {len(index)} {COMPONENT}/binary-amd64/Packages\n")
    (root / REPO_DIR / f"dists/{suite}/Release").write_text(release)


def use_local_pve_repo(twin, suite: str = "bookworm") -> None:
    """The host's Proxmox repository is the local one: the enterprise file (unreachable) set
    aside, the no-subscription one-line file naming file:/opt/pve-repo; apt runs dpkg with the
    twin's stand-ins first on PATH (apt-pkg/deb/dpkgpm.cc DPkg::Path)."""
    root = Path(twin.root)
    aside = root / "root/apt-sources-aside"
    aside.mkdir(parents=True, exist_ok=True)
    for old in (root / "etc/apt/sources.list.d").glob("pve-enterprise.*"):
        shutil.move(str(old), aside / old.name)
    (root / PVE_LIST).write_text(f"deb [trusted=yes] file:/{REPO_DIR} {suite} {COMPONENT}\n")
    (root / "etc/apt/apt.conf.d/99pvegpu-twin-standins").write_text(
        'DPkg::Path "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";\n')


def update_local(twin) -> None:
    """apt's index of the local repository alone (the Debian lists stay as they are)."""
    sh(twin, f"apt-get -q update -o Dir::Etc::sourcelist=/{PVE_LIST} -o Dir::Etc::sourceparts=- "
             "-o APT::Get::List-Cleanup=0")


def move_sources(twin, source: str = "bookworm", target: str = "trixie") -> None:
    """The upgrade guide's step: every apt source of `source` names `target`, each file in its own
    format (Debian's deb822 debian.sources, the one-line Proxmox file)."""
    sh(twin, f"sed -i 's/\\b{source}\\b/{target}/g' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list "
             "$(ls /etc/apt/sources.list 2>/dev/null)")


class Network:
    """This machine's resolver in the twin while the block runs (the twin has none of its own)."""

    def __init__(self, twin):
        self.resolv = Path(twin.root) / "etc/resolv.conf"

    def __enter__(self):
        self.kept = self.resolv.read_bytes()
        shutil.copyfile("/etc/resolv.conf", self.resolv)

    def __exit__(self, *exc):
        self.resolv.write_bytes(self.kept)


def fetch_lists(twin, cache: Path) -> str:
    """Debian's indexes of the moved sources: from `cache` (no update: the package set stays the
    first run's) or `apt-get update` from the mirror (then cached). "cached" | "fetched"."""
    lists, twin_lists = cache / "lists", Path(twin.root) / "var/lib/apt/lists"
    if (lists / ".complete").exists():
        for f in lists.iterdir():
            if f.name != ".complete":
                shutil.copyfile(f, twin_lists / f.name)
        update_local(twin)
        return "cached"
    with Network(twin):
        sh(twin, "apt-get -q update")
    if lists.exists():
        shutil.rmtree(lists)
    lists.mkdir(parents=True)
    for f in twin_lists.iterdir():  # Debian's (the local repository's start with `_`)
        if f.is_file() and not f.name.startswith("_") and f.name != "lock":
            shutil.copyfile(f, lists / f.name)
    (lists / ".complete").write_text("")
    return "fetched"


def fetch_debs(twin, cache: Path) -> int:
    """Every .deb the full-upgrade needs into the twin's apt cache, from `cache`, else the mirror
    (then cached). Returns how many were downloaded."""
    archives, twin_archives = cache / "archives", Path(twin.root) / "var/cache/apt/archives"
    archives.mkdir(parents=True, exist_ok=True)
    for deb in archives.glob("*.deb"):
        if not (twin_archives / deb.name).exists():
            shutil.copyfile(deb, twin_archives / deb.name)
    before = {p.name for p in twin_archives.glob("*.deb")}
    with Network(twin):
        sh(twin, f"{APT_ENV} apt-get -q -y --download-only {DPKG_OPTS} full-upgrade")
    new = [p for p in twin_archives.glob("*.deb") if p.name not in before]
    for deb in new:
        if deb.name.startswith(("proxmox-", "pve-")):
            continue  # the local repository's: built by the test
        part = archives / (deb.name + ".part")
        shutil.copyfile(deb, part)
        part.rename(archives / deb.name)
    return len(new)


def trixie_kernel(twin) -> tuple[str, str]:
    """(release, version) of the headers trixie's linux-headers-amd64 names (apt's candidate, once
    the sources are trixie)."""
    release = sh(twin, "apt-cache depends linux-headers-amd64 | sed -n 's/^ *Depends: linux-headers-\\(.*-amd64\\)$/\\1/p' "
                       "| head -n 1").stdout.strip()
    assert release, "trixie's linux-headers-amd64 names no headers package"
    version = sh(twin, f"apt-cache show --no-all-versions linux-headers-{release} | sed -n 's/^Version: //p'").stdout.strip()
    return release, version


def kernel_config(twin, release: str) -> str:
    """The real .config of Debian's linux-headers-<release> (its .deb in the twin's apt cache)."""
    debs = sorted((Path(twin.root) / "var/cache/apt/archives").glob(f"linux-headers-{release}_*.deb"))
    assert debs, f"no linux-headers-{release} .deb in the twin's apt cache"
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(debs[-1])], check=True, capture_output=True).stdout
    done = subprocess.run(["tar", "-xOf", "-", f"./usr/src/linux-headers-{release}/.config"], input=tar,
                          capture_output=True, check=True)
    return done.stdout.decode()


def image_files(release: str, config: str) -> dict:
    return {f"boot/vmlinuz-{release}": "twin stand-in kernel image\n", f"boot/config-{release}": config,
            f"boot/System.map-{release}": "", f"lib/modules/{release}/modules.order": "",
            f"lib/modules/{release}/modules.builtin": ""}


def full_upgrade(twin, log: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    """The guide's `apt full-upgrade`, unattended, from the twin's apt cache (the twin has no
    resolver now: what fetch_debs did not put there fails; not --no-download, with which apt
    refuses the file: repository's relative pool paths); its output goes to `log`."""
    done = sh(twin, f"{APT_ENV} apt-get -q -y {DPKG_OPTS} full-upgrade", check=False, timeout=timeout)
    log.write_text(done.stdout + done.stderr)
    return done
