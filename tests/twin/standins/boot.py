#!/usr/bin/python3 -IS
"""Twin stand-ins for booting, dispatched on the program name:

proxmox-boot-tool  status | refresh | kernel list | kernel pin <rel> [--next-boot] | kernel unpin [--next-boot]
update-grub        writes /boot/grub/grub.cfg from /etc/default/grub (grub-mkconfig cannot probe
                   devices inside the twin)
reboot, shutdown -r, systemctl reboot   ask the twin's supervisor for a reboot (TWIN-CONTRACT)

zz-proxmox-boot    the kernel hook (/etc/kernel/postinst.d, postrm.d) a kernel package's postinst runs

State: pins in /etc/kernel/proxmox-boot-pin and /etc/kernel/next-boot-pin (as Proxmox keeps them);
the ESPs of /etc/kernel/proxmox-boot-uuids under /var/lib/twin/esp/<uuid>/ (loader/loader.conf,
loader/entries/proxmox-<rel>.conf, EFI/proxmox/<rel>/): written only by `refresh` and the hook,
read by the twin's reboot. `kernel pin` on such a host writes the pin file only.
"""
import os
import re
import shutil
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate  # noqa: E402

PIN = "/etc/kernel/proxmox-boot-pin"
NEXT = "/etc/kernel/next-boot-pin"
ESP_LIST = "/etc/kernel/proxmox-boot-uuids"
# The twin's ESPs: one directory per UUID of ESP_LIST, standing for /dev/disk/by-uuid/<uuid>
# mounted (what systemd-boot reads at the twin's reboot: tests/twin/hardware.py esp_boot_entry).
ESP_ROOT = "/var/lib/twin/esp"
PMX_ESP_DIR = "EFI/proxmox"
LOADER_CONF = "loader/loader.conf"
VFAT_UUID = re.compile(r"[0-9a-fA-F]{4}-[0-9a-fA-F]{4}")


def warn(msg):
    sys.stderr.write(msg + "\n")


def first_line(p):
    """follows proxmox-kernel-helper functions get_first_line(): first line, "" when absent."""
    text = twinstate.read(p)
    return text.split("\n", 1)[0] if text else ""


def kernels():
    """Installed kernels: /boot/vmlinuz-<rel> with /lib/modules/<rel>, oldest first."""
    out = []
    boot = twinstate.path("/boot")
    for name in os.listdir(boot) if os.path.isdir(boot) else []:
        if name.startswith("vmlinuz-"):
            rel = name[len("vmlinuz-"):]
            if os.path.isdir(twinstate.path(f"/lib/modules/{rel}")):
                out.append(rel)
    return sorted(out, key=twinstate.version_key)


def esp_uuids():
    """follows functions loop_esp_list(): non-empty lines of ESP_LIST."""
    return [u.strip() for u in (twinstate.read(ESP_LIST) or "").splitlines() if u.strip()]


def pbt_status(argv=()):
    """follows proxmox-boot-tool status()/_status_detail(): per listed ESP, the kernel versions
    synced onto it (its EFI/proxmox/ directories, as `ls -1` lists them), not those in /boot."""
    quiet = "--quiet" in argv
    if not os.path.isfile(twinstate.path(ESP_LIST)):
        if quiet:
            return 2
        twinstate.die(f"E: {ESP_LIST} does not exist.", 2)
    if quiet:
        return 0
    print("Re-executing '/usr/sbin/proxmox-boot-tool' in new private mount namespace..")
    print("System currently booted with uefi")
    for u in esp_uuids():
        esp = twinstate.path(f"{ESP_ROOT}/{u}")
        if not VFAT_UUID.search(u):
            warn(f"WARN: {u} read from {ESP_LIST} does not look like a VFAT-UUID - skipping")
            continue
        if not os.path.isdir(esp):
            warn(f"WARN: /dev/disk/by-uuid/{u} does not exist - clean '{ESP_LIST}'! - skipping")
            continue
        result = ""
        if os.path.isfile(os.path.join(esp, LOADER_CONF)):
            kdir = os.path.join(esp, PMX_ESP_DIR)
            versions = sorted(os.listdir(kdir)) if os.path.isdir(kdir) else []
            result = f"uefi (versions: {', '.join(versions)})"
        print(f"{u} is configured with: {result}")
    return 0


def esp_cmdline():
    """follows zz-proxmox-boot update_esps(): the first line of /etc/kernel/cmdline (it must
    carry root=), else /proc/cmdline without its initrd= entries. None: refuse."""
    if os.path.isfile(twinstate.path("/etc/kernel/cmdline")):
        cmdline = first_line("/etc/kernel/cmdline")
        if "root=" not in cmdline:
            warn("No root= parameter in /etc/kernel/cmdline found!")
            return None
        return cmdline
    warn("No /etc/kernel/cmdline found - falling back to /proc/cmdline")
    # (/proc/cmdline is the rendered hw/proc/cmdline; outside a running twin read that file)
    proc = (twinstate.read("/proc/cmdline") or twinstate.read("/var/lib/twin/hw/proc/cmdline") or "").strip()
    return re.sub(r"\binitrd=[0-9a-zA-Z\\/.-]*\s*", "", proc).strip()


def esp_sync(install_version=None):
    """follows zz-proxmox-boot update_esps()/update_esp_func(): copy each kernel with an
    initrd to every listed ESP, write its loader entry, point loader.conf's default at the
    next-boot pin, else the pin, else `proxmox-*` (systemd-boot then takes the newest), and
    drop kernels no longer installed. No ESP list: nothing is synced."""
    if not os.path.isfile(twinstate.path(ESP_LIST)):
        warn(f"No {ESP_LIST} found, skipping ESP sync.")
        return 0
    cmdline = esp_cmdline()
    if cmdline is None:
        return 1
    boot_kvers = kernels()
    if install_version and install_version not in boot_kvers and os.path.exists(twinstate.path(f"/boot/vmlinuz-{install_version}")):
        boot_kvers.append(install_version)
    for uuid in esp_uuids():
        if not VFAT_UUID.search(uuid):
            warn(f"WARN: {uuid} read from {ESP_LIST} does not look like a VFAT-UUID - skipping")
            continue
        esp = twinstate.path(f"{ESP_ROOT}/{uuid}")
        dev = f"/dev/disk/by-uuid/{uuid}"
        if not os.path.isdir(esp):
            warn(f"WARN: {dev} does not exist - clean '{ESP_LIST}'! - skipping")
            continue
        if not os.path.isfile(os.path.join(esp, LOADER_CONF)):
            warn(f"{dev} contains no loader.conf - skipping")
            continue
        warn(f"Copying and configuring kernels on {dev}")
        os.makedirs(os.path.join(esp, "loader/entries"), exist_ok=True)
        for kver in boot_kvers:
            image, initrd = f"/boot/vmlinuz-{kver}", f"/boot/initrd.img-{kver}"
            if not os.path.isfile(twinstate.path(image)):
                warn(f"No linux-image {image} found - skipping")
                continue
            if not os.path.isfile(twinstate.path(initrd)):
                warn(f"No initrd-image {initrd} found - skipping")
                continue
            warn(f"\tCopying kernel and creating boot-entry for {kver}")
            live = os.path.join(esp, PMX_ESP_DIR, kver)
            os.makedirs(live, exist_ok=True)
            for src in (image, initrd):
                shutil.copy2(twinstate.path(src), live)
            with open(os.path.join(esp, f"loader/entries/proxmox-{kver}.conf"), "w") as f:
                f.write(f"title    Proxmox Virtual Environment\nversion  {kver}\noptions  {cmdline}\n"
                        f"linux    /{PMX_ESP_DIR}/{kver}/vmlinuz-{kver}\ninitrd   /{PMX_ESP_DIR}/{kver}/initrd.img-{kver}\n")
        pinned = first_line(PIN)
        if os.path.exists(twinstate.path(NEXT)):
            pinned = first_line(NEXT)
        set_loader_default(os.path.join(esp, LOADER_CONF), f"proxmox-{pinned}.conf" if pinned else "proxmox-*")
        # follows zz-proxmox-boot remove_old_kernels_efi(): kernels not in the boot list go
        kdir = os.path.join(esp, PMX_ESP_DIR)
        for kver in sorted(os.listdir(kdir)) if os.path.isdir(kdir) else []:
            if kver not in boot_kvers:
                warn(f"\tRemoving old version {kver}")
                shutil.rmtree(os.path.join(kdir, kver), ignore_errors=True)
                entry = os.path.join(esp, f"loader/entries/proxmox-{kver}.conf")
                if os.path.exists(entry):
                    os.unlink(entry)
    return 0


def set_loader_default(conf, entry):
    """follows functions set_systemd_boot_default(): replace the `default` line, else append one."""
    with open(conf) as f:
        lines = f.read().splitlines()
    done = False
    for i, line in enumerate(lines):
        if line.startswith("default "):
            lines[i] = f"default {entry}"
            done = True
    if not done:
        lines.append(f"default {entry}")
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")


def pbt_refresh(argv=()):
    """follows proxmox-boot-tool refresh(): run the kernel hooks proxmox-auto-removal and
    zz-proxmox-boot (the twin's auto-removal keeps every kernel)."""
    print("Running hook script 'proxmox-auto-removal'..")
    print("Running hook script 'zz-proxmox-boot'..")
    print("Re-executing '/etc/kernel/postinst.d/zz-proxmox-boot' in new private mount namespace..")
    return esp_sync()


def zz_proxmox_boot(argv):
    """/etc/kernel/{postinst,postrm}.d/zz-proxmox-boot as a kernel package's maintainer script
    runs it (run-parts --arg=<version> --arg=<image>): follows zz-proxmox-boot's case on
    $DEB_MAINT_PARAMS (configure/remove or none: sync the ESPs)."""
    params = (os.environ.get("DEB_MAINT_PARAMS") or "").split()
    mode = params[0].strip("'") if params else ""
    if mode not in ("", "configure", "remove"):
        return 0
    return esp_sync(argv[0] if argv and mode != "remove" else None)


def pbt_kernel(args):
    if not args:
        twinstate.die("USAGE: proxmox-boot-tool kernel <add|remove|list|pin|unpin> [<kernel-version>]", 2)
    op, rest = args[0], args[1:]
    next_boot = "--next-boot" in rest
    rest = [a for a in rest if a != "--next-boot"]
    if op == "list":
        print("Manually selected kernels:\nNone.\n")
        print("Automatically selected kernels:")
        print("\n".join(kernels()))
        pin, nxt = first_line(PIN), first_line(NEXT)
        if pin:
            print(f"\nPinned kernel:\n{pin}")
        if nxt:
            print(f"\nKernel pinned on next-boot:\n{nxt}")
        return 0
    if op == "pin":
        # follows proxmox-boot-tool pin_kernel()
        if not rest:
            twinstate.die("E: <kernel-version> is mandatory", 1)
        rel = rest[0]
        if not os.path.exists(twinstate.path(f"/boot/vmlinuz-{rel}")):
            twinstate.die(f"E: no kernel image found in /boot for '{rel}', not setting default.", 1)
        where = NEXT if next_boot else PIN
        old = first_line(where)
        if old and old != rel:
            print(f"Overriding previously pinned version '{old}' with '{rel}'")
        twinstate.write(where, rel + "\n")
        if os.path.isfile(twinstate.path(ESP_LIST)):
            # ESPs listed: only the pin file; the loader changes at `refresh` (no terminal: no prompt)
            print(f"Set kernel '{rel}' in {where}. Use the 'refresh' command to update the ESPs.")
        else:
            print(f"Setting '{first_line(NEXT) or rel}' as grub default entry and running update-grub.")
            update_grub([])
        if next_boot:
            print("Pinned for next boot only.")
        return 0
    if op == "unpin":
        # follows proxmox-boot-tool unpin_kernel(): --next-boot removes only that pin
        last = first_line(NEXT)
        p = twinstate.path(NEXT)
        if os.path.exists(p):
            os.unlink(p)
        print(f"Removed {NEXT}.")
        if not next_boot:
            last = first_line(PIN) or last
            if os.path.exists(twinstate.path(PIN)):
                os.unlink(twinstate.path(PIN))
            print(f"Removed {PIN}.")
        if os.path.isfile(twinstate.path(ESP_LIST)):
            if last:
                print(f"Unpinned kernel '{last}'. Use the 'refresh' command to update the ESPs.")
        else:
            print("Reset default grub entry and running update-grub.")
            update_grub([])
        return 0
    twinstate.die(f"E: invalid 'kernel' subcommand '{op}'.", 1)


def proxmox_boot_tool(argv):
    if not argv:
        twinstate.die("USAGE: proxmox-boot-tool <commands> [ARGS]", 2)
    cmd = argv[0]
    if cmd == "status":
        return pbt_status(argv[1:])
    if cmd == "refresh":
        return pbt_refresh(argv[1:])
    if cmd == "kernel":
        return pbt_kernel(argv[1:])
    twinstate.die(f"E: unknown command '{cmd}'", 2)


def grub_defaults():
    """Values of /etc/default/grub (+ grub.d/*.cfg) as the shell sees them."""
    files = [twinstate.path("/etc/default/grub")]
    d = twinstate.path("/etc/default/grub.d")
    if os.path.isdir(d):
        files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".cfg")]
    script = "".join(f'[ -f "{f}" ] && . "{f}"\n' for f in files)
    script += 'printf "%s\\n%s\\n%s\\n" "$GRUB_CMDLINE_LINUX" "$GRUB_CMDLINE_LINUX_DEFAULT" "$GRUB_DEFAULT"\n'
    import subprocess  # only update-grub needs it; proxmox-boot-tool status runs on every converge

    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True).stdout.split("\n")
    return out[0], out[1], out[2]


def update_grub(argv):
    linux, default, _ = grub_defaults()
    root = (twinstate.profile().get("boot") or {}).get("root", "/dev/mapper/pve-root")
    rels = list(reversed(kernels()))
    pin = (twinstate.read(NEXT) or twinstate.read(PIN) or "").strip()
    if pin in rels:
        rels.remove(pin)
        rels.insert(0, pin)  # the pinned kernel becomes the default entry
    sys.stderr.write("Generating grub configuration file ...\n")
    entries = []
    for rel in rels:
        sys.stderr.write(f"Found linux image: /boot/vmlinuz-{rel}\nFound initrd image: /boot/initrd.img-{rel}\n")
        args = " ".join(x for x in (f"root={root} ro", linux, default) if x)
        entries.append(f"menuentry 'Proxmox VE GNU/Linux, with Linux {rel}' --class proxmox {{\n"
                       f"\tlinux\t/boot/vmlinuz-{rel} {args}\n\tinitrd\t/boot/initrd.img-{rel}\n}}\n")
    twinstate.write("/boot/grub/grub.cfg", "### generated by the twin's update-grub stand-in ###\n"
                    "set default=\"0\"\n" + "".join(entries))
    sys.stderr.write("done\n")
    return 0


def request_reboot(how):
    """Log now; touch the request from a detached child a moment later, so the caller (often an
    SSH session) gets its exit status before the supervisor kills sshd, as with a real reboot."""
    with open(twinstate.path("/var/lib/twin/reboot.log"), "a") as f:
        f.write(f"{twinstate.now_iso()} {how}\n")
    if os.fork() == 0:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        time.sleep(0.3)
        with open(twinstate.path("/var/lib/twin/reboot-request"), "w") as f:
            f.write(how + "\n")
        os._exit(0)
    return 0


def systemctl(argv):
    verbs = [a for a in argv if not a.startswith("-")]
    if verbs[:1] == ["reboot"]:
        return request_reboot("systemctl " + " ".join(argv))
    for real in ("/usr/bin/systemctl", "/bin/systemctl"):
        if os.path.exists(real) and os.path.realpath(real) != os.path.realpath(sys.argv[0]):
            os.execv(real, [real] + argv)
    twinstate.die("System has not been booted with systemd as init system (PID 1). Can't operate.", 1)


def shutdown(argv):
    if "-r" in argv or "--reboot" in argv:
        return request_reboot("shutdown " + " ".join(argv))
    twinstate.die("twin: only 'shutdown -r' is supported (a twin cannot power off)", 1)


HANDLERS = {"proxmox-boot-tool": proxmox_boot_tool, "update-grub": update_grub, "zz-proxmox-boot": zz_proxmox_boot,
            "reboot": lambda a: request_reboot("reboot " + " ".join(a)), "shutdown": shutdown,
            "systemctl": systemctl}
PROGRAMS = tuple(HANDLERS)


def main(prog, argv):
    """Run stand-in `prog` (what the program was called as) with `argv`; its exit status."""
    return twinstate.dispatch(HANDLERS, "boot", prog, argv)


if __name__ == "__main__":
    sys.exit(main(os.path.basename(sys.argv[0]), sys.argv[1:]))
