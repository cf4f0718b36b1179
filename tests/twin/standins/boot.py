#!/usr/bin/python3 -IS
"""Twin stand-ins for booting, dispatched on the program name:

update-grub        writes /boot/grub/grub.cfg from /etc/default/grub as grub-mkconfig would
                   (it cannot probe devices inside the twin), running the other scripts of
                   /etc/grub.d; grub-reboot, grub-set-default and grub-editenv are the real
                   Debian programs (grub2-common)
10_linux           /etc/grub.d/10_linux: the Linux entries for the exported GRUB_* values
grub-probe         --target=abstraction|fs only (the profile's boot.grubenv_abstraction, grubenv_fs)
reboot, shutdown -r, systemctl reboot   ask the twin's supervisor for a reboot (TWIN-CONTRACT)
systemctl is-system-running [--wait]     "starting" while the boot's onboot guest starts run, then
                   "running" (tests/twin/runtime.py Supervisor.boot)

proxmox-boot-tool, its kernel hooks (zz-proxmox-boot, proxmox-auto-removal) and bootctl are the
real programs (proxmox-kernel-helper built from source and systemd's, in the twin's root: tests/twin/
runtime.py KERNEL_HELPER); the block devices, mounts and NVRAM they need are standins/esp.sh and
tests/twin/hardware.py (esp_devices, EFIVARS), the firmware's choice at a reset hardware.esp_boot_entry.
"""
import os
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate  # noqa: E402


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


GRUB_NAMES = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT", "GRUB_DEFAULT", "GRUB_DISTRIBUTOR",
              "GRUB_DISABLE_RECOVERY", "GRUB_DISABLE_SUBMENU")


def grub_defaults():
    """Values of /etc/default/grub (+ grub.d/*.cfg) as the shell sees them (grub-mkconfig sources
    them in this order)."""
    files = [twinstate.path("/etc/default/grub")]
    d = twinstate.path("/etc/default/grub.d")
    if os.path.isdir(d):
        files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".cfg")]
    script = "".join(f'[ -f "{f}" ] && . "{f}"\n' for f in files)
    script += "".join(f'printf "%s\\n" "${name}"\n' for name in GRUB_NAMES)
    import subprocess  # only update-grub needs it; proxmox-boot-tool status runs on every converge

    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True).stdout.split("\n")
    return dict(zip(GRUB_NAMES, out, strict=False))


def grub_device_id():
    """The id 10_linux puts in the entry ids (boot_device_id: the root file system's UUID)."""
    boot = twinstate.profile().get("boot") or {}
    if boot.get("fs_uuid"):
        return boot["fs_uuid"]
    import hashlib
    h = hashlib.sha256(str(twinstate.profile().get("name", "twin")).encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def grub_10_linux(g):
    """What /etc/grub.d/10_linux prints for the GRUB_* values `g` (grub-mkconfig exports them to
    every script): follows 10_linux.in: a plain entry for the newest kernel, then the 'Advanced
    options' submenu with every kernel, newest first, each with its recovery entry unless
    GRUB_DISABLE_RECOVERY=true; with GRUB_DISABLE_SUBMENU true/y/yes no plain entry and no
    submenu, every kernel's entry at the top level; ids gnulinux-simple-<dev>,
    gnulinux-advanced-<dev>, gnulinux-<version>-advanced-<dev>; args GRUB_CMDLINE_LINUX then
    GRUB_CMDLINE_LINUX_DEFAULT."""
    root = (twinstate.profile().get("boot") or {}).get("root", "/dev/mapper/pve-root")
    dev = grub_device_id()
    os_name = f"{g.get('GRUB_DISTRIBUTOR') or 'Debian'} GNU/Linux"
    flat = (g.get("GRUB_DISABLE_SUBMENU") or "") in ("true", "y", "yes")
    rels = list(reversed(kernels()))
    out = []

    def entry(title, ident, rel, args, indent=""):
        return (f"{indent}menuentry '{title}' --class proxmox $menuentry_id_option '{ident}' {{\n"
                f"{indent}\tlinux\t/boot/vmlinuz-{rel} root={root} ro {args}\n"
                f"{indent}\tinitrd\t/boot/initrd.img-{rel}\n{indent}}}\n")

    normal = f"{g.get('GRUB_CMDLINE_LINUX') or ''} {g.get('GRUB_CMDLINE_LINUX_DEFAULT') or ''}".strip()
    indent = ""
    for i, rel in enumerate(rels):
        sys.stderr.write(f"Found linux image: /boot/vmlinuz-{rel}\nFound initrd image: /boot/initrd.img-{rel}\n")
        if i == 0 and not flat:
            out.append(entry(os_name, f"gnulinux-simple-{dev}", rel, normal))
            out.append(f"submenu 'Advanced options for {os_name}' $menuentry_id_option 'gnulinux-advanced-{dev}' {{\n")
            indent = "\t"
        out.append(entry(f"{os_name}, with Linux {rel}", f"gnulinux-{rel}-advanced-{dev}", rel, normal, indent))
        if g.get("GRUB_DISABLE_RECOVERY") != "true":
            out.append(entry(f"{os_name}, with Linux {rel} (recovery mode)", f"gnulinux-{rel}-recovery-{dev}", rel,
                             " ".join(x for x in ("single", g.get("GRUB_CMDLINE_LINUX")) if x), indent))
    if rels and not flat:
        out.append("}\n")
    return "".join(out)


def linux_10(argv):
    """/etc/grub.d/10_linux run by itself (a grub.d script of ours runs it): the GRUB_* values
    from the environment, as grub-mkconfig exported them."""
    sys.stdout.write(grub_10_linux({name: os.environ.get(name, "") for name in GRUB_NAMES}))
    return 0


GRUB_D = "/etc/grub.d"
# grub-common's scripts that the twin does not run: 00_header and 10_linux are the stand-in's own
# (update_grub, grub_10_linux: the real ones probe devices the twin cannot show); the theme, Xen,
# os-prober and firmware-setup scripts add no Linux entry on a server. Every other executable
# script of /etc/grub.d (40_custom, 41_custom, those other packages or the admin put there) runs.
GRUB_D_OWN = ("00_header", "10_linux")
GRUB_D_NOT_MODELLED = ("05_debian_theme", "20_linux_xen", "30_os-prober", "30_uefi-firmware")


def grub_file_is_not_garbage(name):
    """follows grub-mkconfig_lib grub_file_is_not_garbage() (and grub-mkconfig's editor backups)."""
    return not (name.endswith("~") or (name.startswith("#") and name.endswith("#")) or ".dpkg-" in name
                or name.endswith((".rpmsave", ".rpmnew", ".sig")) or name.startswith("README"))


def update_grub(argv):
    """grub-mkconfig cannot probe devices inside the twin; this writes what it would:
    follows grub-mkconfig.in (GRUB_DEFAULT=saved becomes ${saved_entry}; the scripts of
    /etc/grub.d run in name order with GRUB_* exported, each one's output between BEGIN/END
    lines), util/grub.d/00_header.in (load_env; next_entry boots once and is cleared with
    save_env; else the default) and 10_linux.in (grub_10_linux). The scripts other than the
    stand-in's own run only inside the twin (TWIN_ROOT /): never on the machine that seeds it."""
    import subprocess

    g = grub_defaults()
    default = g["GRUB_DEFAULT"] or "0"
    if default == "saved":
        default = "${saved_entry}"
    sys.stderr.write("Generating grub configuration file ...\n")
    out = ["### generated by the twin's update-grub stand-in ###\n",
           "### BEGIN /etc/grub.d/00_header ###\n",
           "if [ -s $prefix/grubenv ]; then\n  set have_grubenv=true\n  load_env\nfi\n",
           'if [ "${next_entry}" ] ; then\n   set default="${next_entry}"\n   set next_entry=\n'
           "   save_env next_entry\n   set boot_once=true\nelse\n"
           f'   set default="{default}"\nfi\n',
           "### END /etc/grub.d/00_header ###\n"]
    env = {**os.environ, **g}
    grub_d = twinstate.path(GRUB_D)
    for name in sorted(os.listdir(grub_d)) if os.path.isdir(grub_d) else ["10_linux"]:
        script = os.path.join(grub_d, name)
        if name == "00_header" or name in GRUB_D_NOT_MODELLED or not grub_file_is_not_garbage(name):
            continue
        if name == "10_linux":
            text = grub_10_linux(g)
        elif twinstate.ROOT != "/" or not (os.path.isfile(script) and os.access(script, os.X_OK)):
            continue
        else:
            done = subprocess.run([script], env=env, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                twinstate.die(f"/usr/sbin/grub-mkconfig: {script} failed (exit {done.returncode})", 1)
            text = done.stdout
        out.append(f"### BEGIN {GRUB_D}/{name} ###\n{text}### END {GRUB_D}/{name} ###\n")
    twinstate.write("/boot/grub/grub.cfg", "".join(out))
    sys.stderr.write("done\n")
    return 0


def grub_probe(argv):
    """grub-probe --target=abstraction|fs PATH: what the profile says holds /boot/grub
    (boot.grubenv_abstraction, e.g. `lvm`; empty: a plain partition; boot.grubenv_fs, GRUB's
    name of its file system: `ext2` for ext2/3/4 (grub-core/fs/ext2.c), `btrfs`, `zfs`, …;
    ext2 when the profile says none). Every other use fails as the real grub-probe does inside
    the twin (it cannot see the twin's block devices)."""
    targets = [a.split("=", 1)[1] for a in argv if a.startswith("--target=")]
    boot = twinstate.profile().get("boot") or {}
    if targets == ["abstraction"]:
        value = boot.get("grubenv_abstraction")
        if value is not None:
            if value:
                print(value)
            return 0
    if targets == ["fs"] and boot.get("grubenv_abstraction") is not None:
        print(boot.get("grubenv_fs") or "ext2")
        return 0
    twinstate.die("grub-probe: error: failed to get canonical path of `overlay'.", 1)


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


# Written by the twin's supervisor (tests/twin/runtime.py Supervisor.boot) before sshd starts and
# removed once the boot's jobs (the onboot guest starts, as pve-guests.service) are done.
BOOT_JOBS = "/run/twin/boot-jobs"


def is_system_running(argv):
    """`systemctl is-system-running [--wait] [-q]`: "starting" while the boot's jobs run, then
    "running"; exit 0 only for "running"; --wait blocks while the boot is not done."""
    # systemd src/systemctl/systemctl-is-system-running.c verb_is_system_running: with --wait and the
    # state "initializing"/"starting" it waits for the manager's StartupFinished, then prints the state
    while "--wait" in argv and os.path.exists(twinstate.path(BOOT_JOBS)):
        time.sleep(0.1)
    state = "starting" if os.path.exists(twinstate.path(BOOT_JOBS)) else "running"
    if "-q" not in argv and "--quiet" not in argv:
        print(state)
    return 0 if state == "running" else 1


def systemctl(argv):
    verbs = [a for a in argv if not a.startswith("-")]
    if verbs[:1] == ["reboot"]:
        return request_reboot("systemctl " + " ".join(argv))
    if verbs[:1] == ["is-system-running"]:
        return is_system_running(argv)
    for real in ("/usr/bin/systemctl", "/bin/systemctl"):
        if os.path.exists(real) and os.path.realpath(real) != os.path.realpath(sys.argv[0]):
            os.execv(real, [real] + argv)
    twinstate.die("System has not been booted with systemd as init system (PID 1). Can't operate.", 1)


def shutdown(argv):
    if "-r" in argv or "--reboot" in argv:
        return request_reboot("shutdown " + " ".join(argv))
    twinstate.die("twin: only 'shutdown -r' is supported (a twin cannot power off)", 1)


HANDLERS = {"update-grub": update_grub, "10_linux": linux_10, "grub-probe": grub_probe,
            "reboot": lambda a: request_reboot("reboot " + " ".join(a)), "shutdown": shutdown,
            "systemctl": systemctl}
PROGRAMS, main = twinstate.standin(HANDLERS, "boot")

if __name__ == "__main__":
    twinstate.run_program(main)
