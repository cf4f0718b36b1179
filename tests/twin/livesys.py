"""Live sysfs of a twin started with `live_sysfs=True`: a small kernel model behind the PCI
driver-binding files, served by the supervisor (tests/twin/runtime.py) inside the twin's
namespaces, so a shell in the twin rebinds a GPU the way it does on a real host.

How the files are served: a FUSE file system (raw protocol over /dev/fuse, no library) run by a
thread of the supervisor exposes one file per control file; each is bind-mounted over the
rendered placeholder in /sys:

    /sys/bus/pci/drivers/<drv>/unbind, .../bind, /sys/bus/pci/drivers_probe   (mode 0200)

A write(2) to one of them blocks until the model has applied it and fails with the kernel's
errno (ENODEV for an unbind of a device the driver does not hold, ...), as the kernel's
synchronous sysfs stores do. `driver_override` stays a regular file of the rendered tree (rw);
the model reads it at probe time ("(null)" or empty: none). A writer blocked in a slow unbind
(fault knob below) cannot be killed until the unbind is done, like a writer in the kernel's
unbind (FUSE waits out a request userspace has read); a twin shutdown or reboot answers it.

Effects, kept consistent with what `tests.twin.hardware.compute` gives at the next boot:
devices/.../driver and drivers/<drv>/<bdf> links, `enable`, uevent DRIVER=, hw/state.json
(`drivers`, the GPU list: driver, minor, index), /proc/driver/nvidia/gpus/<bdf>/, /dev nodes
(/dev/nvidiaN made when a GPU gets minor N; /dev/vfio/<group> made and removed with the group).
A reboot renders everything again from the persisted config.

Faults: <root>/var/lib/twin/faults.json {"unbind_delay_s": N} makes each unbind take N s
(runtime.set_fault).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Kernel model

SYS_REL = "var/lib/twin/hw/sys"
PROC_REL = "var/lib/twin/hw/proc"
STATE_REL = "var/lib/twin/hw/state.json"
FAULTS_REL = "var/lib/twin/faults.json"
NVIDIA_MAJOR = 195
NVIDIA_MINOR_MAX = 247  # follows nv-chardev-numbers.h NV_MINOR_DEVICE_NUMBER_REGULAR_MAX (GPU minors 0..247)
# module -> the PCI driver it registers (as tests.twin.hardware._render_sys names them)
DRIVER_OF_MODULE = {"nvidia": "nvidia", "vfio_pci": "vfio-pci", "snd_hda_intel": "snd_hda_intel",
                    "mlx5_core": "mlx5_core", "nvme": "nvme"}


class KernelModel:
    """PCI driver core + the nvidia and vfio-pci probe/remove effects on a twin root."""

    def __init__(self, root: Path, log=print):
        self.root = Path(root)
        self.hw_sys = self.root / SYS_REL
        self.lock = threading.Lock()
        self.alive = True  # False once the twin shuts down or reboots: late writes change nothing
        self.shutdown = threading.Event()  # cuts a slow unbind short at shutdown (see close())
        self.on_driver: Callable[[str], None] | None = None  # called with a driver name when a module load registers it
        self.log = log
        from tests.twin import hardware  # the twin's boot computation (paths, texts)

        self.hardware = hardware
        self.profile = hardware.load_profile(self.root / "var/lib/twin/profile.yml")
        self.by_bdf = {d["bdf"]: d for d in self.profile["pci"]}

    # -- state
    def state(self) -> dict:
        return json.loads((self.root / STATE_REL).read_text())

    def save(self, st: dict) -> None:
        path = self.root / STATE_REL
        tmp = path.with_name(".state.json.tmp")
        tmp.write_text(json.dumps(st, indent=1, sort_keys=True))
        os.replace(tmp, path)  # a stand-in reading it never sees half a file
        (self.root / "var/lib/twin/hw/dev.json").write_text(json.dumps(st["dev_nodes"], indent=1))

    def drivers_loaded(self) -> list[str]:
        d = self.hw_sys / "bus/pci/drivers"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def dev_dir(self, bdf: str) -> Path:
        return self.hw_sys / self.hardware._dev_rel(self.by_bdf, bdf)

    def override(self, bdf: str) -> str | None:
        # follows drivers/base/driver.c driver_set_override(): one trailing newline dropped,
        # empty clears it; shown as "(null)" when unset (pci-driver.c driver_override_show)
        try:
            text = (self.dev_dir(bdf) / "driver_override").read_text()
        except OSError:
            return None
        text = text[:-1] if text.endswith("\n") else text
        return None if text in ("", "(null)") else text

    def close(self) -> None:
        """The twin shuts down or reboots: writes still in the model fail (ENODEV) and change nothing."""
        with self.lock:
            self.alive = False
        self.shutdown.set()

    @staticmethod
    def parse_bdf(data: bytes) -> str:
        # follows drivers/base/core.c device_match_name() -> sysfs_streq(): a trailing newline is ignored
        return data.decode(errors="replace").removesuffix("\n").strip("\0")

    # -- the stores
    def unbind(self, drv: str, data: bytes) -> None:
        """follows drivers/base/bus.c unbind_store(): ENODEV unless `drv` holds the device."""
        bdf = self.parse_bdf(data)
        with self.lock:
            st = self.state()
            if not self.alive or st["drivers"].get(bdf) != drv:
                raise OSError(errno.ENODEV, bdf)
        delay = self.fault("unbind_delay_s")
        if delay:
            # the fault knob: a driver's remove() that takes its time. Its writer cannot be killed
            # meanwhile (FUSE waits for the answer once the request is read, as an unbind in the
            # kernel does); a shutdown answers it at once (close()) so the twin can stop.
            self.shutdown.wait(delay)
        with self.lock:
            if not self.alive:
                raise OSError(errno.ENODEV, bdf)
            st = self.state()
            if bdf not in st["drivers"] or st["drivers"][bdf] != drv:
                raise OSError(errno.ENODEV, bdf)
            self._release(st, bdf)
            self.save(st)

    def bind(self, drv: str, data: bytes) -> None:
        """follows drivers/base/bus.c bind_store(): ENODEV when the device is unknown or the
        driver does not match it; EBUSY (device_driver_attach) when it already has a driver."""
        bdf = self.parse_bdf(data)
        with self.lock:
            if not self.alive:
                raise OSError(errno.ENODEV, bdf)
            st = self.state()
            if bdf not in st["drivers"] or not self._matches(st, drv, bdf):
                raise OSError(errno.ENODEV, bdf)
            if st["drivers"][bdf]:
                raise OSError(errno.EBUSY, bdf)
            err = self._probe(st, drv, bdf)
            if err:
                raise OSError(err, bdf)
            self.save(st)

    def drivers_probe(self, data: bytes) -> None:
        """follows drivers/base/bus.c drivers_probe_store() -> bus_rescan_devices_helper(): a bound
        device is left alone; an unbound one gets the first loaded driver that matches and
        probes (none matching is no error)."""
        bdf = self.parse_bdf(data)
        with self.lock:
            if not self.alive:
                raise OSError(errno.ENODEV, bdf)
            st = self.state()
            if bdf not in st["drivers"]:
                raise OSError(errno.ENODEV, bdf)
            if st["drivers"][bdf]:
                return
            for drv in self.drivers_loaded():
                if self._matches(st, drv, bdf) and not self._probe(st, drv, bdf):
                    break
            self.save(st)

    def load_module(self, data: bytes) -> None:
        """`modprobe NAME` of a PCI driver module (the twin's modprobe stand-in writes NAME to
        /run/twin-sysfs/load_module): the module is listed as loaded, its driver registered and
        attached to every unbound device it matches (follows drivers/base/bus.c bus_add_driver()
        -> dd.c driver_attach()); vfio_pci brings vfio and /dev/vfio/vfio (vfio_main.c
        vfio_init(): misc device 10:196). ENOENT for a module the twin does not know."""
        name = data.decode(errors="replace").strip().replace("-", "_")
        drv = DRIVER_OF_MODULE.get(name)
        with self.lock:
            if not self.alive:
                raise OSError(errno.ENODEV, name)
            st = self.state()
            if name in st["modules"]:
                return
            if drv is None:
                raise OSError(errno.ENOENT, name)
            new = (["vfio", "vfio_iommu_type1", "vfio_pci_core"] if name == "vfio_pci" else []) + [name]
            for mod in new:
                if mod in st["modules"]:
                    continue
                st["modules"].append(mod)
                mdir = self.hw_sys / "module" / mod
                mdir.mkdir(parents=True, exist_ok=True)
                (mdir / "initstate").write_text("live\n")
            with open(self.root / PROC_REL / "modules", "a") as modules:  # as the boot renders it
                for mod in new:
                    modules.write(f"{mod} 1048576 0 - Live 0x0000000000000000\n")
            if "vfio" in new:
                self._mknod(st, "/dev/vfio/vfio", 10, 196, 0o666)
            if name == "nvidia":  # control device minor 255 (nv-chardev-numbers.h), node as nvidia-modprobe makes it
                st["nvidia"]["loaded"] = True
                self._mknod(st, "/dev/nvidiactl", NVIDIA_MAJOR, 255, 0o666)
            ddir = self.hw_sys / "bus/pci/drivers" / drv
            ddir.mkdir(parents=True, exist_ok=True)
            for f in ("bind", "unbind", "new_id", "remove_id"):
                (ddir / f).touch()
            if self.on_driver is not None:
                self.on_driver(drv)  # the bind/unbind files of the new driver go live
            for bdf in sorted(st["drivers"]):
                if not st["drivers"][bdf] and self._matches(st, drv, bdf):
                    self._probe(st, drv, bdf)
            self.save(st)

    # -- matching and probing
    def _matches(self, st: dict, drv: str, bdf: str) -> bool:
        """follows drivers/pci/pci-driver.c pci_match_device(): an override names the only driver
        that may match (any name that is no driver, e.g. "none", leaves the device unbound);
        without one, the driver's id table: here the device's driver in the profile."""
        if drv not in self.drivers_loaded():
            return False
        override = self.override(bdf)
        if override is not None:
            return override == drv
        dev = self.by_bdf[bdf]
        if drv == "vfio-pci":  # vfio-pci's table is empty but for ids= (vfio_pci.c vfio_pci_fill_ids)
            ids = st.get("module_params", {}).get("vfio_pci", {}).get("ids", "")
            return f"{dev['vendor']}:{dev['device']}".lower() in ids.lower().split(",")
        return dev.get("driver") == drv

    def _probe(self, st: dict, drv: str, bdf: str) -> int:
        """0 when `drv` takes the device (links, state), else the errno its probe returns."""
        dev = self.by_bdf[bdf]
        if drv == "nvidia" and not dev.get("gpu"):
            return errno.ENODEV  # follows nv.c nv_pci_probe(): only NVIDIA display/3D controllers
        if drv == "vfio-pci":
            if dev.get("bridge") or dev.get("class", "").startswith("0604"):
                return errno.EINVAL  # follows vfio_pci.c vfio_pci_probe(): normal header type only
            if not st["iommu"]["enabled"] or dev.get("iommu_group") is None:
                return errno.EINVAL  # follows vfio group.c vfio_device_set_group(): needs an IOMMU group
        self._link(st, bdf, drv)
        if drv == "nvidia":
            self._nvidia_add(st, bdf)
        if drv == "vfio-pci":
            self._vfio_add(st, bdf)
        return 0

    def _release(self, st: dict, bdf: str) -> None:
        """follows drivers/base/dd.c device_release_driver(): remove(), then the links go."""
        drv = st["drivers"][bdf]
        if drv == "nvidia":
            self._nvidia_remove(st, bdf)
        if drv == "vfio-pci":
            self._vfio_remove(st, bdf)
        self._link(st, bdf, None)

    def _link(self, st: dict, bdf: str, drv: str | None) -> None:
        """The sysfs side of a (un)bind, laid out as hardware._render_sys lays out a boot."""
        rel = self.hardware._dev_rel(self.by_bdf, bdf)
        d = self.hw_sys / rel
        old = st["drivers"].get(bdf)
        if old:
            (self.hw_sys / "bus/pci/drivers" / old / bdf).unlink(missing_ok=True)
            (d / "driver").unlink(missing_ok=True)
        if drv:
            # follows drivers/base/dd.c driver_sysfs_add(): both links
            self.hardware._symlink(d / "driver", "../" * (rel.count("/") + 1) + f"bus/pci/drivers/{drv}")
            self.hardware._symlink(self.hw_sys / "bus/pci/drivers" / drv / bdf, "../../../../" + rel)
        st["drivers"][bdf] = drv
        (d / "enable").write_text("1\n" if drv else "0\n")  # as the twin's boot renders it
        lines = [x for x in (d / "uevent").read_text().splitlines() if not x.startswith("DRIVER=")]
        (d / "uevent").write_text("\n".join(([f"DRIVER={drv}"] if drv else []) + lines) + "\n")
        for g in st["gpus"]:
            if g["bdf"] == bdf:
                g["driver"] = drv
        for n in st.get("nics", []):
            if n["bdf"] == bdf:
                n["driver"] = drv

    # -- nvidia
    def _nvidia_add(self, st: dict, bdf: str) -> None:
        gpu = next(g for g in st["gpus"] if g["bdf"] == bdf)
        used = {g["minor"] for g in st["gpus"] if g.get("minor") is not None}
        # follows nv.c nv_linux_assign_minor_locked(): the lowest free minor
        gpu["minor"] = next(i for i in range(NVIDIA_MINOR_MAX + 1) if i not in used)
        self._nvidia_indices(st)
        # follows nv-procfs.c nv_procfs_add_gpu() (called from nv_pci_probe)
        info = self.root / PROC_REL / "driver/nvidia/gpus" / bdf / "information"
        info.parent.mkdir(parents=True, exist_ok=True)
        info.write_text(self.hardware._gpu_information(gpu, st["nvidia"]))
        # The driver makes no node itself; on a host NVML runs nvidia-modprobe -c N (nvidia-modprobe
        # nvidia-modprobe-utils.c nvidia_mknod) the first time the GPU is used: the twin makes it now.
        self._mknod(st, f"/dev/nvidia{gpu['minor']}", NVIDIA_MAJOR, gpu["minor"], 0o666)

    def _nvidia_remove(self, st: dict, bdf: str) -> None:
        gpu = next(g for g in st["gpus"] if g["bdf"] == bdf)
        # follows nv.c nv_pci_remove(): minor freed (nv_linux_remove_minor_locked), procfs entry
        # removed (nv-procfs.c nv_procfs_remove_gpu); /dev/nvidiaN stays: nothing removes it on a
        # host (nvidia-modprobe only creates or replaces nodes)
        gpu["minor"] = None
        self._nvidia_indices(st)
        info_dir = self.root / PROC_REL / "driver/nvidia/gpus" / bdf
        for p in info_dir.glob("*"):
            p.unlink()
        if info_dir.is_dir():
            info_dir.rmdir()

    @staticmethod
    def _nvidia_indices(st: dict) -> None:
        # NVML numbers the attached GPUs in PCI bus order (nvidia-smi's index)
        bound = sorted((g for g in st["gpus"] if g.get("minor") is not None), key=lambda g: g["bdf"])
        for g in st["gpus"]:
            g["index"] = None
        for i, g in enumerate(bound):
            g["index"] = i

    # -- vfio
    def _vfio_group(self, st: dict, bdf: str):
        return self.by_bdf[bdf].get("iommu_group")

    def _vfio_add(self, st: dict, bdf: str) -> None:
        grp = self._vfio_group(st, bdf)
        path = f"/dev/vfio/{grp}"
        if any(n["path"] == path for n in st["dev_nodes"]):
            return
        # follows drivers/vfio/group.c vfio_group_alloc(): minor from an IDA (lowest free), node by devtmpfs
        major = st["char_majors"].get("vfio", 509)
        used = {n["minor"] for n in st["dev_nodes"] if n["path"].startswith("/dev/vfio/") and n["path"] != "/dev/vfio/vfio"}
        minor = next(i for i in range(1 << 16) if i not in used)
        self._mknod(st, path, major, minor, 0o600)

    def _vfio_remove(self, st: dict, bdf: str) -> None:
        grp = self._vfio_group(st, bdf)
        others = [b for b, d in st["drivers"].items()
                  if d == "vfio-pci" and b != bdf and self.by_bdf[b].get("iommu_group") == grp]
        if not others:  # follows drivers/vfio/group.c vfio_group_release(): the last device takes the node
            path = f"/dev/vfio/{grp}"
            st["dev_nodes"] = [n for n in st["dev_nodes"] if n["path"] != path]
            (self.root / path.lstrip("/")).unlink(missing_ok=True)

    def _mknod(self, st: dict, path: str, major: int, minor: int, mode: int) -> None:
        target = self.root / path.lstrip("/")
        if not any(n["path"] == path for n in st["dev_nodes"]):
            st["dev_nodes"].append({"path": path, "major": major, "minor": minor, "mode": mode})
        if os.path.lexists(target):
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(target, mode | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(target, mode)

    def fault(self, key: str) -> float:
        try:
            return float(json.loads((self.root / FAULTS_REL).read_text()).get(key) or 0)
        except (OSError, ValueError, AttributeError):
            return 0.0


# ---------------------------------------------------------------------------------------------
# FUSE (protocol: include/uapi/linux/fuse.h; only what a few write-only files need)

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_SETATTR = 1, 2, 3, 4
FUSE_OPEN, FUSE_READ, FUSE_WRITE, FUSE_STATFS, FUSE_RELEASE = 14, 15, 16, 17, 18
FUSE_FLUSH, FUSE_INIT, FUSE_OPENDIR, FUSE_READDIR, FUSE_RELEASEDIR = 25, 26, 27, 28, 29
FUSE_INTERRUPT, FUSE_DESTROY, FUSE_BATCH_FORGET = 36, 38, 42
NO_REPLY = (FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT)
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen pad
OUT_HEADER = struct.Struct("<IiQ")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
FOPEN_DIRECT_IO = 1


class FuseFiles:
    """A flat FUSE directory of write-only files, each served by a callback(data) that raises
    OSError(errno) to fail the write. Mounted at `mountpoint`; bind each file where it belongs."""

    def __init__(self, mountpoint: Path, log=print):
        self.mountpoint = Path(mountpoint)
        self.files: dict[str, tuple[int, Callable[[bytes], None]]] = {}  # name -> (nodeid, callback)
        self.nodes: dict[int, str] = {}
        self.log = log
        self.fd = -1
        self.reply_lock = threading.Lock()

    def add(self, name: str, callback) -> Path:
        if name in self.files:
            nodeid = self.files[name][0]
        else:
            nodeid = len(self.nodes) + 2  # 1 is the root directory
            self.nodes[nodeid] = name
        self.files[name] = (nodeid, callback)
        return self.mountpoint / name

    def mount(self) -> None:
        from tests.twin.runtime import MS_NODEV, MS_NOSUID, _mount

        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        _mount("twin-sysfs", self.mountpoint, "fuse", MS_NOSUID | MS_NODEV,
               f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other")
        threading.Thread(target=self.serve, name="twin-sysfs", daemon=True).start()

    def _attr(self, nodeid: int) -> bytes:
        now = int(time.time())
        mode = (stat.S_IFDIR | 0o755) if nodeid == 1 else (stat.S_IFREG | 0o200)
        return ATTR.pack(nodeid, 4096 if nodeid == 1 else 4096, 0, now, now, now, 0, 0, 0,
                         mode, 2 if nodeid == 1 else 1, 0, 0, 0, 4096, 0)

    def reply(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        msg = OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body
        try:
            with self.reply_lock:
                os.write(self.fd, msg)
        except OSError as e:  # ENOENT: the request was interrupted (its writer was killed)
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                self.log(f"twin-sysfs: reply failed: {e}")

    def serve(self) -> None:
        while True:
            try:
                buf = os.read(self.fd, 1 << 17)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                os.close(self.fd)
                return  # ENODEV: unmounted (the twin stops or reboots)
            try:
                self.handle(buf)
            except Exception:
                self.log(f"twin-sysfs: {traceback.format_exc()}")

    def handle(self, buf: bytes) -> None:
        _, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(buf)
        arg = buf[IN_HEADER.size:]
        if opcode in NO_REPLY:
            return
        if opcode == FUSE_INIT:
            major, minor, readahead, _flags = struct.unpack_from("<IIII", arg)
            body = struct.pack("<IIIIHHIIHHII6I", 7, min(minor, 31), readahead, 0, 16, 12,
                               4096, 1, 0, 0, 0, 0, *[0] * 6)
            self.reply(unique, 0, body)
        elif opcode == FUSE_LOOKUP:
            name: str | None = arg.split(b"\0", 1)[0].decode()
            if nodeid != 1 or name not in self.files:
                self.reply(unique, errno.ENOENT)
            else:
                nid = self.files[name][0]
                self.reply(unique, 0, struct.pack("<QQQQII", nid, 0, 3600, 1, 0, 0) + self._attr(nid))
        elif opcode in (FUSE_GETATTR, FUSE_SETATTR):
            if nodeid != 1 and nodeid not in self.nodes:
                self.reply(unique, errno.ENOENT)
            else:
                self.reply(unique, 0, struct.pack("<QII", 1, 0, 0) + self._attr(nodeid))
        elif opcode in (FUSE_OPEN, FUSE_OPENDIR):
            flags = struct.unpack_from("<I", arg)[0]
            if opcode == FUSE_OPEN and (flags & os.O_ACCMODE) != os.O_WRONLY:
                self.reply(unique, errno.EACCES)  # kernfs: no show(), no read access
            else:
                self.reply(unique, 0, struct.pack("<QII", 0, FOPEN_DIRECT_IO, 0))
        elif opcode == FUSE_WRITE:
            size = struct.unpack_from("<QQIIQII", arg)[2]
            data = bytes(arg[40:40 + size])
            name = self.nodes.get(nodeid)
            # each write in its own thread: a slow unbind (fault knob) leaves the rest served
            threading.Thread(target=self._write, args=(unique, name, data), daemon=True).start()
        elif opcode == FUSE_READDIR:
            self.reply(unique, 0, b"")
        elif opcode in (FUSE_RELEASE, FUSE_RELEASEDIR, FUSE_FLUSH, FUSE_DESTROY):
            self.reply(unique, 0)
        else:
            self.reply(unique, errno.ENOSYS)

    def _write(self, unique: int, name: str | None, data: bytes) -> None:
        if name is None:
            self.reply(unique, errno.ENOENT)
            return
        try:
            self.files[name][1](data)
        except OSError as e:
            self.reply(unique, e.errno or errno.EIO)
            return
        except Exception:
            self.log(f"twin-sysfs {name}: {traceback.format_exc()}")
            self.reply(unique, errno.EIO)
            return
        self.reply(unique, 0, struct.pack("<II", len(data), 0))


# ---------------------------------------------------------------------------------------------
# Wiring (the supervisor calls serve() at each boot, after its mounts)

FUSE_DIR = "run/twin-sysfs"  # inside the twin's root (its /run tmpfs): the FUSE mount


def serve(root: Path, log=print) -> KernelModel:
    """Mount the FUSE files and bind them over /sys's driver-binding files of the twin at `root`
    (called in the twin's mount namespace). Returns the model."""
    from tests.twin.runtime import MS_BIND, _mount

    root = Path(root)
    model = KernelModel(root, log)
    fuse = FuseFiles(root / FUSE_DIR, log)
    fuse.mount()
    sys_dir = root / "sys"

    def bind_file(name: str, callback, target: Path) -> None:
        source = fuse.add(name, callback)
        if target.exists():
            _mount(str(source), target, flags=MS_BIND)

    def driver_files(drv: str) -> None:
        bind_file(f"unbind@{drv}", lambda data: model.unbind(drv, data),
                  sys_dir / "bus/pci/drivers" / drv / "unbind")
        bind_file(f"bind@{drv}", lambda data: model.bind(drv, data),
                  sys_dir / "bus/pci/drivers" / drv / "bind")

    bind_file("drivers_probe", model.drivers_probe, sys_dir / "bus/pci/drivers_probe")
    for drv in model.drivers_loaded():
        driver_files(drv)
    fuse.add("load_module", model.load_module)  # /run/twin-sysfs/load_module: the modprobe stand-in
    model.on_driver = driver_files
    return model
