"""The twin's stand-in for NVIDIA's driver installer, NVIDIA-Linux-x86_64-<version>.run.

    build(version, dest_dir) -> Path    writes dest_dir/NVIDIA-Linux-x86_64-<version>.run
    payload_files(version) -> {path in the package: (mode, bytes)}

The file is a POSIX sh script followed by an uncompressed ustar payload (byte offset in the
script). Same bytes on every build: sorted entries, fixed mtime/owner/modes, no compression (so no
zlib version can change the sha256 that inventories pin). hardware.install puts the profile's
version at /opt/nvidia/ in the twin, as an operator's download would be.

Behaviour, for the flags pvegpu uses (run as `sh NVIDIA-Linux-x86_64-<v>.run ...`):
    --silent --no-kernel-modules [--no-nouveau-check, other --no-*, --accept-license, --ui=none, -q ...]
        when nouveau is bound to a PCI device (a /sys/bus/pci/devices/*/driver link whose last
        part is "nouveau") and --no-nouveau-check is absent: writes nvidia-installer-disable-nouveau.conf
        ("blacklist nouveau", "options nouveau modeset=0") into each of /etc/modprobe.d and
        /usr/lib/modprobe.d that exists, prints an ERROR and exits 1 before any library is touched
        (follows nvidia-installer misc.c nouveau_is_present() and check_for_nouveau(): under --silent
        the offer to write the files takes its default, yes, and the continue-or-abort question
        its default, abort; install-from-cwd.c runs the check with --no-kernel-modules too; the
        initramfs rebuild the real one may do on abort is not modelled). Then it installs user space: removes every libnvidia-ml.so* / libcuda.so* in
        /usr/lib/x86_64-linux-gnu first (nvidia-installer removes a previous driver and
        conflicting libraries), then installs libnvidia-ml.so.<v> (+ .so.1), libcuda.so.<v>
        (+ .so.1, .so), /usr/bin/nvidia-smi (a wrapper running the twin's nvidia-smi stand-in:
        the CT's view inside a twin container, the host's otherwise), the GSP firmware into
        /lib/firmware/nvidia/<v>/ (follows nvidia-installer manifest.c
        get_installable_file_type_list(): --no-kernel-modules skips no FIRMWARE entry; files.c
        puts them under /lib/firmware/nvidia/<version>/) and writes
        /var/log/nvidia-installer.log. Libraries and firmware are placeholders (text, not ELF).
    without --no-kernel-modules   refused (exit 1) before anything is written: the twin builds
        no modules this way
    --extract-only|-x [--target DIR]   the package tree into DIR (default ./NVIDIA-Linux-x86_64-<v>):
        firmware/gsp_ga10x.bin, firmware/gsp_tu10x.bin, the libraries, nvidia-smi
    --version|-v    a blank line, then "nvidia-installer:  version <v>" and a description
                    (nvidia-installer.c print_version(): NV_ID_STRING; the .run's makeself header
                    passes the option on to the extracted nvidia-installer)
    PVEGPU_TWIN_INSTALL_ROOT=DIR (environment; tests only, the twin never sets it): every absolute
        path the installer reads or writes (/sys, /etc, /usr, /lib, /var) is taken under DIR
    anything else   "ERROR: Unrecognized option" (exit 1)
"""
from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

MTIME = 1704067200  # 2024-01-01: fixed, and not so old that tar warns about it
LIBDIR = "/usr/lib/x86_64-linux-gnu"

NVIDIA_SMI = """\
#!/bin/sh
# nvidia-smi from the pvegpu twin's NVIDIA installer: the twin's stand-in answers. Inside a twin
# container `pct exec` mounts the twin's state and stand-in under /run/twin.
if [ -e /run/twin/ct.json ]; then
    exec env TWIN_ROOT=/run/twin/root TWIN_CT=1 /usr/bin/python3 /run/twin/root/usr/local/lib/twin/bin/nvidia-smi "$@"
fi
exec /usr/local/bin/nvidia-smi "$@"
"""

SCRIPT = r"""#!/bin/sh
# NVIDIA-Linux-x86_64-@VERSION@.run: the pvegpu digital twin's stand-in for NVIDIA's installer
# (tests/twin/installer.py). An sh script; an uncompressed tar follows at byte @OFFSET@.
VERSION=@VERSION@
OFFSET=@OFFSET@
PKG=NVIDIA-Linux-x86_64-$VERSION
LIBDIR=@LIBDIR@
R=${PVEGPU_TWIN_INSTALL_ROOT:-}
LIBDIR=$R$LIBDIR
LOG=$R/var/log/nvidia-installer.log
ARGS="$*"
silent=0; kmods=1; extract=0; target=; nouveau_check=1
while [ $# -gt 0 ]; do
    case "$1" in
        --silent|-s) silent=1 ;;
        --no-kernel-modules|--no-kernel-module) kmods=0 ;;
        --no-nouveau-check|-z) nouveau_check=0 ;;
        --no-*|--accept-license|-a|--ui=none|--no-questions|-q) ;;
        --extract-only|-x) extract=1 ;;
        --target) [ $# -ge 2 ] || { echo 'ERROR: --target needs a directory' >&2; exit 1; }; shift; target=$1 ;;
        --target=*) target=${1#--target=} ;;
        --version|-v) printf '\nnvidia-installer:  version %s\n  The pvegpu twin stand-in of NVIDIA'"'"'s driver installer.\n\n' "$VERSION"; exit 0 ;;
        *) echo "ERROR: Unrecognized option: \"$1\"" >&2; exit 1 ;;
    esac
    shift
done
unpack() { tail -c +$((OFFSET + 1)) "$0" | tar -xf - --no-same-owner --strip-components=1 -C "$1"; }
say() { [ $silent = 1 ] || echo "$*"; }
if [ $extract = 1 ]; then
    target=${target:-$PKG}
    mkdir -p "$target" && unpack "$target" || { echo "ERROR: unable to extract $PKG into $target" >&2; exit 1; }
    say "Creating directory $target"
    say "Uncompressing NVIDIA Accelerated Graphics Driver for Linux-x86_64 $VERSION"
    exit 0
fi
if [ $kmods = 1 ]; then  # refused before anything is written
    echo "ERROR: the pvegpu twin's NVIDIA installer cannot build kernel modules; run it with --no-kernel-modules (pvegpu builds the modules itself)" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then echo 'ERROR: nvidia-installer must be run as root' >&2; exit 1; fi
mkdir -p "$R/var/log"
{ echo "nvidia-installer log file '$LOG'"; echo "creation time: $(date)"; echo "installer version: $VERSION"
  echo "command line: $0 $ARGS"; } > "$LOG"
if [ $nouveau_check = 1 ]; then
    bound=
    for d in "$R"/sys/bus/pci/devices/*; do
        [ "$(basename "$(readlink "$d/driver" 2>/dev/null)" 2>/dev/null)" = nouveau ] && bound="$bound ${d##*/}"
    done
    if [ -n "$bound" ]; then
        echo "WARNING: the nouveau driver is in use (PCI$bound); it must be disabled before the NVIDIA driver installs" >&2
        written=
        for dir in "$R/etc/modprobe.d" "$R/usr/lib/modprobe.d"; do
            [ -d "$dir" ] || continue
            printf '# generated by nvidia-installer\nblacklist nouveau\noptions nouveau modeset=0\n' > "$dir/nvidia-installer-disable-nouveau.conf"
            written="$written $dir/nvidia-installer-disable-nouveau.conf"
        done
        echo "nouveau in use; wrote$written; installation aborted" >> "$LOG"
        echo "ERROR: Installation has failed: nouveau is in use; modprobe configuration written to disable it:$written. Reboot, or rerun with --no-nouveau-check" >&2
        exit 1
    fi
fi
tmp=$(mktemp -d) && unpack "$tmp" || { echo "ERROR: unable to extract $PKG" >&2; exit 1; }
mkdir -p "$LIBDIR" "$R/usr/bin"
for f in "$LIBDIR"/libnvidia-ml.so* "$LIBDIR"/libcuda.so*; do
    if [ -e "$f" ] || [ -L "$f" ]; then rm -f "$f"; echo "removed previous/conflicting file $f" >> "$LOG"; fi
done
for lib in libnvidia-ml libcuda; do
    install -m 755 "$tmp/$lib.so.$VERSION" "$LIBDIR/$lib.so.$VERSION"
    ln -sf "$lib.so.$VERSION" "$LIBDIR/$lib.so.1"
    echo "installed $LIBDIR/$lib.so.$VERSION, $LIBDIR/$lib.so.1" >> "$LOG"
done
ln -sf libcuda.so.1 "$LIBDIR/libcuda.so"
install -m 755 "$tmp/nvidia-smi" "$R/usr/bin/nvidia-smi"
echo "installed /usr/bin/nvidia-smi" >> "$LOG"
mkdir -p "$R/lib/firmware/nvidia/$VERSION"
for f in "$tmp"/firmware/*.bin; do
    install -m 644 "$f" "$R/lib/firmware/nvidia/$VERSION/${f##*/}"
    echo "installed /lib/firmware/nvidia/$VERSION/${f##*/}" >> "$LOG"
done
rm -rf "$tmp"
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: $VERSION) is now complete." >> "$LOG"
say "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: $VERSION) is now complete."
exit 0
"""


def _check_version(version: str) -> None:
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version):
        raise ValueError(f"NVIDIA driver version {version!r}: want digits like 595.71.05")


def payload_files(version: str) -> dict[str, tuple[int, bytes]]:
    """{path inside NVIDIA-Linux-x86_64-<v>/: (mode, content)}."""
    _check_version(version)
    return {
        "firmware/gsp_ga10x.bin": (0o644, f"twin placeholder: GSP firmware ga10x {version}\n".encode()),
        "firmware/gsp_tu10x.bin": (0o644, f"twin placeholder: GSP firmware tu10x {version}\n".encode()),
        f"libnvidia-ml.so.{version}": (0o755, f"twin placeholder: NVML {version}\n".encode()),
        f"libcuda.so.{version}": (0o755, f"twin placeholder: CUDA driver library {version}\n".encode()),
        "nvidia-smi": (0o755, NVIDIA_SMI.encode()),
    }


def _payload(version: str) -> bytes:
    top = f"NVIDIA-Linux-x86_64-{version}"
    files = payload_files(version)
    dirs = {top} | {f"{top}/{p.rsplit('/', 1)[0]}" for p in files if "/" in p}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        entries = [(d, None) for d in dirs] + [(f"{top}/{p}", v) for p, v in files.items()]
        for name, value in sorted(entries):
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "root", "root"
            if value is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode, info.size = value[0], len(value[1])
                tar.addfile(info, io.BytesIO(value[1]))
    return buf.getvalue()


def script(version: str, offset: int) -> bytes:
    return (SCRIPT.replace("@VERSION@", version).replace("@LIBDIR@", LIBDIR)
            .replace("@OFFSET@", str(offset)).encode())


def build(version: str, dest: Path) -> Path:
    """Write dest/NVIDIA-Linux-x86_64-<version>.run (mode 0755); same bytes on every build."""
    _check_version(version)
    offset = 0
    while len(script(version, offset)) != offset:  # the offset names the script's own length
        offset = len(script(version, offset))
    path = Path(dest) / f"NVIDIA-Linux-x86_64-{version}.run"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(script(version, offset) + _payload(version))
    path.chmod(0o755)
    return path
