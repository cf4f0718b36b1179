#!/usr/bin/python3 -IS
"""Twin stand-ins for booting, dispatched on the program name:

proxmox-boot-tool  status | refresh | kernel list | kernel pin <rel> [--next-boot] | kernel unpin [--next-boot]
update-grub        writes /boot/grub/grub.cfg from /etc/default/grub (grub-mkconfig cannot probe
                   devices inside the twin)
reboot, shutdown -r, systemctl reboot   ask the twin's supervisor for a reboot (TWIN-CONTRACT)

State: pins in /etc/kernel/proxmox-boot-pin and /etc/kernel/next-boot-pin (as Proxmox keeps them);
the cmdline a systemd-boot ESP was last synced with in /var/lib/twin/boot/cmdline.
"""
import os
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate  # noqa: E402

PIN = "/etc/kernel/proxmox-boot-pin"
NEXT = "/etc/kernel/next-boot-pin"


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


def loader():
    return (twinstate.profile().get("boot") or {}).get("loader", "none")


def pbt_status():
    print("Re-executing '/usr/sbin/proxmox-boot-tool' in new private mount namespace..")
    if loader() != "systemd-boot":
        twinstate.die("E: /etc/kernel/proxmox-boot-uuids does not exist.", 2)
    uuid = (twinstate.read("/etc/kernel/proxmox-boot-uuids") or "").split()
    print("System currently booted with uefi")
    for u in uuid:
        print(f"{u} is configured with: uefi (versions: {', '.join(kernels())})")
    return 0


def pbt_refresh():
    print("Running hook script 'proxmox-auto-removal'..")
    print("Running hook script 'zz-proxmox-boot'..")
    print("Re-executing '/etc/kernel/postinst.d/zz-proxmox-boot' in new private mount namespace..")
    if loader() != "systemd-boot":
        print("No /etc/kernel/proxmox-boot-uuids found, skipping ESP sync.")
        if loader() == "grub":
            return update_grub([])
        return 0
    cmdline = twinstate.read("/etc/kernel/cmdline")
    if cmdline is None:
        twinstate.die("E: /etc/kernel/cmdline does not exist", 2)
    uuid = (twinstate.read("/etc/kernel/proxmox-boot-uuids") or "").split()
    for u in uuid:
        print(f"Copying and configuring kernels on /dev/disk/by-uuid/{u}")
        for rel in kernels():
            print(f"\tCopying kernel and creating boot-entry for {rel}")
    twinstate.write("/var/lib/twin/boot/cmdline", " ".join(cmdline.split()) + "\n")
    return 0


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
        pin, nxt = (twinstate.read(PIN) or "").strip(), (twinstate.read(NEXT) or "").strip()
        if pin:
            print(f"\nPinned kernel:\n{pin}")
        if nxt:
            print(f"\nKernel pinned on next-boot:\n{nxt}")
        return 0
    if op == "pin":
        if not rest:
            twinstate.die("E: <kernel-version> is mandatory for 'pin'", 2)
        rel = rest[0]
        if rel not in kernels():
            twinstate.die(f"E: no kernel image found in /boot for '{rel}', not setting default.", 2)
        twinstate.write(NEXT if next_boot else PIN, rel + "\n")
        where = NEXT if next_boot else PIN
        if loader() == "grub":
            print(f"Setting '{rel}' as grub default entry and running update-grub.")
            update_grub([])
        else:
            print(f"Set kernel '{rel}' in {where}.")
            print("Refresh the actual boot ESPs now? [yN] ", end="")
            print()
        return 0
    if op == "unpin":
        p = twinstate.path(NEXT if next_boot else PIN)
        if os.path.exists(p):
            os.unlink(p)
        if not next_boot and os.path.exists(twinstate.path(NEXT)):
            os.unlink(twinstate.path(NEXT))  # unpin without --next-boot clears both
        print("Removed kernel pin." if not next_boot else "Removed next-boot kernel pin.")
        return 0
    twinstate.die(f"E: unknown kernel subcommand '{op}'", 2)


def proxmox_boot_tool(argv):
    if not argv:
        twinstate.die("USAGE: proxmox-boot-tool <commands> [ARGS]", 2)
    cmd = argv[0]
    if cmd == "status":
        return pbt_status()
    if cmd == "refresh":
        return pbt_refresh()
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


HANDLERS = {"proxmox-boot-tool": proxmox_boot_tool, "update-grub": update_grub,
            "reboot": lambda a: request_reboot("reboot " + " ".join(a)), "shutdown": shutdown,
            "systemctl": systemctl}
PROGRAMS = tuple(HANDLERS)


def main(prog, argv):
    """Run stand-in `prog` (what the program was called as) with `argv`; its exit status."""
    return twinstate.dispatch(HANDLERS, "boot", prog, argv)


if __name__ == "__main__":
    sys.exit(main(os.path.basename(sys.argv[0]), sys.argv[1:]))
